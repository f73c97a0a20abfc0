"""`bnrecal calibrate` as a user runs it: results, report, and one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import run_cli, save_array, save_state
from tests.nets import mixed_net, no_norm_net, perturbed, self_stats_net
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics


pytestmark = pytest.mark.usefixtures("cli_environment")


@pytest.fixture
def artifacts(tmp_path: Path) -> dict[str, Path]:
    torch.manual_seed(3)
    model = perturbed(mixed_net())
    samples = torch.randn(20, 3, 6, 5)
    return {
        "model": model,
        "samples": samples,
        "checkpoint": save_state(tmp_path / "model.pt", model),
        "data": save_array(tmp_path / "x.npy", samples.numpy()),
    }


@pytest.mark.usefixtures("ray_cluster", "cli_warm_ranks")
def test_calibrate_writes_checkpoint_and_report(artifacts, tmp_path, capsys):
    out, report = tmp_path / "out.pt", tmp_path / "report.json"
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(artifacts["checkpoint"]),
        "--data", str(artifacts["data"]), "--workers", "2", "--batch-size", "8", "--out", str(out),
        "--report", str(report),
    )
    assert code == 0, err
    model = mixed_net()
    model.load_state_dict(torch.load(out, weights_only=True))
    assert_matches_reference(model, reference_statistics(artifacts["model"], in_contract_order(artifacts["samples"]), 8))
    content = json.loads(report.read_text())
    for key in ("mode", "world_size", "backend", "device", "samples", "steps", "collectives", "seconds",
                "samples_per_second", "nodes", "layers"):
        assert key in content, key
    assert content["collectives"] == 5 * 3 and content["world_size"] == 2 and content["backend"] == "gloo"
    assert {layer["name"] for layer in content["layers"]} == {"bn", "bn_dw", "bn_plain", "bn_seq", "bn_fc"}
    old, new = artifacts["model"].state_dict(), model.state_dict()
    for layer in content["layers"]:  # drift, from the two checkpoints' buffers in float64
        ratios = new[f"{layer['name']}.running_var"].double() / old[f"{layer['name']}.running_var"].double()
        assert layer["var_ratio_max"] == pytest.approx(ratios.max().item(), rel=1e-9)
        assert layer["var_ratio_min"] == pytest.approx(ratios.min().item(), rel=1e-9)
        assert layer["var_ratio_min"] < layer["var_ratio_max"] and layer["mean_shift"] > 0
    assert "recalibrated 5 BN layers on 20 samples" in err


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {EVIL_MARKER}",))


EVIL_MARKER = Path("/tmp/bnrecal-test-evil-marker")


def bad_inputs(tmp_path: Path, artifacts: dict[str, Path]) -> dict[str, tuple[list[str], str]]:
    ckpt, data = str(artifacts["checkpoint"]), str(artifacts["data"])
    extra = {**artifacts["model"].state_dict(), "stray.weight": torch.zeros(1)}
    torch.save(extra, tmp_path / "extra.pt")
    partial = dict(artifacts["model"].state_dict())
    partial.pop("fc.weight")
    torch.save(partial, tmp_path / "partial.pt")
    (tmp_path / "corrupt.pt").write_bytes(b"PK\x03\x04 definitely not a checkpoint")
    whole = artifacts["checkpoint"].read_bytes()
    (tmp_path / "half.pt").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"state_dict": Evil()}))
    save_array(tmp_path / "wrong.npy", np.zeros((4, 5, 6, 5), np.float32))
    save_array(tmp_path / "empty.npy", np.zeros((0, 3, 6, 5), np.float32))
    torch.save(no_norm_net().state_dict(), tmp_path / "nonorm.pt")
    save_array(tmp_path / "vec.npy", np.zeros((4, 4), np.float32))
    torch.save(self_stats_net().state_dict(), tmp_path / "selfstats.pt")
    save_array(tmp_path / "img.npy", np.random.default_rng(0).standard_normal((4, 3, 7, 6)).astype(np.float32))
    save_array(tmp_path / "nhwc.npy", artifacts["samples"].numpy().transpose(0, 2, 3, 1).copy())
    return {
        "unknown arch": (["--arch", "torchvision:resnet1800", "--checkpoint", ckpt], "resnet1800"),
        "module not allowed": (["--arch", "os:getcwd", "--checkpoint", ckpt], "BNRECAL_MODEL_MODULES"),
        "unexpected keys": (["--arch", "tests.nets:mixed_net", "--checkpoint", str(tmp_path / "extra.pt")], "stray.weight"),
        "missing keys": (["--arch", "tests.nets:mixed_net", "--checkpoint", str(tmp_path / "partial.pt")], "fc.weight"),
        "corrupt file": (["--arch", "tests.nets:mixed_net", "--checkpoint", str(tmp_path / "corrupt.pt")], "corrupt.pt"),
        "truncated file": (
            ["--arch", "tests.nets:mixed_net", "--checkpoint", str(tmp_path / "half.pt")],
            "error: checkpoint 'half.pt' is truncated or not a torch/safetensors file",
        ),
        "code in pickle": (["--arch", "tests.nets:mixed_net", "--checkpoint", str(tmp_path / "evil.pt")], "unpickl"),
        "shape rejected": (["--arch", "tests.nets:mixed_net", "--checkpoint", ckpt, "--data", str(tmp_path / "wrong.npy")], "rejects samples of shape (5, 6, 5)"),
        "no batchnorm": (["--arch", "tests.nets:no_norm_net", "--checkpoint", str(tmp_path / "nonorm.pt"), "--data", str(tmp_path / "vec.npy")], "no BatchNorm"),
        "empty dataset": (["--arch", "tests.nets:mixed_net", "--checkpoint", ckpt, "--data", str(tmp_path / "empty.npy")], "empty"),
        "bad kwargs json": (["--arch", "tests.nets:mixed_net", "--checkpoint", ckpt, "--model-kwargs", "{oops"], "--model-kwargs"),
        "bad mode": (["--arch", "tests.nets:mixed_net", "--checkpoint", ckpt, "--mode", "async"], "--mode"),
        "zero workers": (["--arch", "tests.nets:mixed_net", "--checkpoint", ckpt, "--workers", "0"], "workers"),
        "channels-last data": (
            ["--arch", "tests.nets:mixed_net", "--checkpoint", ckpt, "--data", str(tmp_path / "nhwc.npy")],
            "rejects samples of shape (6, 5, 3): it takes (3, H, W); your data looks channels-last: "
            "transpose it to channels-first, e.g. x.transpose(0, 3, 1, 2)",
        ),
        "mistyped source": (["--arch", "torchvison:resnet18", "--checkpoint", ckpt], "did you mean torchvision:resnet18?"),
        "uncalibratable layer": (
            ["--arch", "tests.nets:self_stats_net", "--checkpoint", str(tmp_path / "selfstats.pt"),
             "--data", str(tmp_path / "img.npy")],
            "BN layer 'bn' of class tests.nets.SelfStatsBatchNorm2d cannot be calibrated",
        ),
    }


CASES = [
    "unknown arch", "module not allowed", "unexpected keys", "missing keys", "corrupt file", "truncated file", "code in pickle",
    "shape rejected", "no batchnorm", "empty dataset", "bad kwargs json", "bad mode", "zero workers",
    "uncalibratable layer", "channels-last data", "mistyped source",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(case, artifacts, tmp_path, capsys):
    EVIL_MARKER.unlink(missing_ok=True)
    args, expected = bad_inputs(tmp_path, artifacts)[case]
    if "--data" not in args:
        args = [*args, "--data", str(artifacts["data"])]
    code, _, err = run_cli(capsys, "calibrate", *args, "--out", str(tmp_path / "never.pt"))
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "never.pt").exists()
    assert not EVIL_MARKER.exists()


@pytest.mark.usefixtures("ray_cluster")
def test_image_folder_with_default_transform(tmp_path, capsys):
    from sklearn.datasets import load_digits

    digits = load_digits()
    for index in range(12):
        label = int(digits.target[index])
        folder = tmp_path / "digits" / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (digits.images[index] * (255 / 16)).astype(np.uint8)
        Image.fromarray(pixels).resize((40, 32)).save(folder / f"{index:03d}.png")
    model = perturbed(mixed_net())
    save_state(tmp_path / "model.pt", model)
    out = tmp_path / "out.pt"
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(tmp_path / "model.pt"),
        "--data", str(tmp_path / "digits"), "--batch-size", "5", "--out", str(out),
    )
    assert code == 0, err
    from bnrecal.workers.data import describe_dataset

    spec = describe_dataset(tmp_path / "digits")  # the default: ImageNet evaluation preset
    samples = spec.open().load(0, spec.num_samples)
    assert samples.shape == (12, 3, 224, 224)
    assert spec.classes == tuple(sorted({f"class_{int(t)}" for t in digits.target[:12]}))
    recalibrated = mixed_net()
    recalibrated.load_state_dict(torch.load(out, weights_only=True))
    assert_matches_reference(recalibrated, reference_statistics(model, in_contract_order(samples), 5))


def test_console_script_runs_end_to_end(artifacts, tmp_path):
    """The installed `bnrecal` script, in its own process with its own embedded Ray."""
    script = Path(sys.executable).parent / "bnrecal"
    env = {**os.environ, "BNRECAL_MODEL_MODULES": "tests", "PYTHONPATH": str(Path(__file__).parents[3])}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [str(script), "calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(artifacts["checkpoint"]),
         "--data", str(artifacts["data"]), "--batch-size", "8", "--out", str(tmp_path / "o.pt"),
         "--report", str(tmp_path / "r.json")],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "r.json").read_text())["world_size"] == 1
    bad = subprocess.run(
        [str(script), "calibrate", "--arch", "nope", "--checkpoint", "x", "--data", "y", "--out", "z"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_submit_takes_every_calibrate_flag():
    import typer.main

    from bnrecal.service.cli import app

    commands = typer.main.get_command(app).commands
    flags = {name: {opt for param in commands[name].params for opt in param.opts} for name in ("calibrate", "submit")}
    assert flags["calibrate"] <= flags["submit"]
    assert flags["submit"] - flags["calibrate"] == {"--server", "--api-key"}
