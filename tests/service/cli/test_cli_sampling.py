"""The sampling flags of ``bnrecal calibrate``: ``--order``, ``--seed``, ``--max-samples auto``
and ``--tolerance``, their errors (exit 2, one line), and the summary line that says how
precise the statistics are."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_cli, save_array, save_state
from tests.nets import mixed_net, perturbed


pytestmark = pytest.mark.usefixtures("cli_environment")


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    torch.manual_seed(2)
    samples = torch.randn(960, 3, 6, 5)
    return {
        "checkpoint": save_state(tmp_path / "model.pt", perturbed(mixed_net())),
        "data": save_array(tmp_path / "x.npy", samples.numpy()),
    }


def calibrate(capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path, *flags: str) -> tuple[int, str]:
    """``bnrecal calibrate`` of the files with ``flags``: exit code and stderr."""
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(files["checkpoint"]),
        "--data", str(files["data"]), "--out", str(tmp_path / "out.pt"), "--report", str(tmp_path / "r.json"), *flags,
    )
    return code, err


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--max-samples", "lots"], '--max-samples: Input should be a valid integer or "auto"'),
        (["--max-samples", "0"], "--max-samples: Input should be greater than or equal to 1"),
        (["--max-samples", "auto", "--mode", "local"], '--max-samples: --max-samples "auto" needs mode sync'),
        (["--tolerance", "0.1"], '--tolerance: tolerance applies only with --max-samples "auto"'),
        (["--max-samples", "auto", "--tolerance", "1.5"], "tolerance"),
        (["--order", "random"], "--order"),
        (["--seed", "-1"], "seed"),
    ],
)
def test_bad_sampling_flags_are_one_line_and_exit_2(files, tmp_path, capsys, flags, expected):
    code, err = calibrate(capsys, files, tmp_path, *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0]
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.usefixtures("ray_cluster", "cli_warm_ranks")
def test_auto_says_where_the_statistics_converged(files, tmp_path, capsys):
    code, err = calibrate(capsys, files, tmp_path, "--max-samples", "auto", "--tolerance", "0.1", "-b", "16", "-k", "2")
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    convergence = report["convergence"]
    assert convergence["converged"] and report["samples"] < 960
    worst = convergence["worst"]
    line = (f"statistics converged at {report['samples']:,} of 960 samples: every standard error under +-10.0%, "
            f"about how far more data of the same kind would move them "
            f"(worst: {worst['layer']}, {worst['statistic']} +-{worst['error']:.1%})")
    assert line in err


@pytest.mark.usefixtures("ray_cluster")
def test_given_order_and_a_seed_are_reported_and_the_precision_shown(files, tmp_path, capsys):
    code, err = calibrate(capsys, files, tmp_path, "--max-samples", "64", "--order", "given", "-b", "16")
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["order"], report["seed"], report["samples"]) == ("given", None, 64)
    worst = report["standard_error_max"]
    assert (f"statistics +-{worst['error']:.1%}, the standard error of 64 samples: about how far more data of the "
            f"same kind would move them (worst: {worst['layer']}, {worst['statistic']} +-{worst['error']:.1%}; "
            f"order given)") in err
    code, err = calibrate(capsys, files, tmp_path, "--max-samples", "64", "--seed", "7", "-b", "16")
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and (report["order"], report["seed"]) == ("shuffled", 7)
    assert "order shuffled, seed 7" in err
    assert np.isfinite(report["standard_error_max"]["error"])
