"""One worker in the calling process (docs/python.md, "Where it runs, and how the model
gets there"; docs/cli.md, "One worker, no Ray"): ``bnrecal calibrate --workers 1`` without
a Ray address runs the engine's pass here, without Ray, to the statistics of the Ray
ranks at every K (sync) and of one Ray rank (local), with ``backend: in-process``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import save_array, save_state
from tests.nets import mixed_net, perturbed
from tests.reference import assert_matches_reference, reference_statistics

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.Tensor, Path, Path]:
    torch.manual_seed(7)
    folder = tmp_path_factory.mktemp("in_process")
    model = perturbed(mixed_net())
    samples = torch.randn(23, 3, 6, 5) * 1.3 - 0.4
    return model, samples, save_state(folder / "model.pt", model), save_array(folder / "x.npy", samples)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("mode", ["sync", "local"])
def test_in_process_gives_the_ray_ranks_statistics(mixed, settings, warm_pool, mode):
    model, samples, checkpoint, data = mixed

    def run(workers: int, in_process: bool = False):
        request = RecalibrationRequest(arch="tests.nets:mixed_net", checkpoint=checkpoint, data=data,
                                       workers=workers, batch_size=6, mode=mode, max_samples=22,
                                       order="given")  # the file's first 22, as the reference reads them
        return recalibrate(request, settings, pool=None if in_process else warm_pool, in_process=in_process)

    here = run(1, in_process=True)
    assert_matches_reference(here.model, reference_statistics(model, samples[:22], batch_size=6))
    others = {1: run(1)} if mode == "local" else {1: run(1), 2: run(2)}  # local mode at K=2 is another statistic
    for k, result in others.items():
        for key, value in result.updates.items():
            torch.testing.assert_close(here.updates[key].double(), value.double(), rtol=1e-5, atol=1e-7, msg=f"K={k} {key}")
    report = here.report
    assert report["backend"] == "in-process" and report["world_size"] == 1 and report["embedded_cluster"] is False
    assert report["placement"] == report["data_transport"] == "in-process"  # no Ray placement group was made
    assert report["samples"] == 22 and report["steps"] == 4 and len(report["nodes"]) == 1
    assert report["collectives"] == others[1].report["collectives"]
    assert [layer["name"] for layer in report["layers"]] == [layer["name"] for layer in others[1].report["layers"]]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``bnrecal`` in a fresh process, which then says whether it imported Ray."""
    script = (
        "import sys\nfrom bnrecal.service.cli.main import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n"
        "    print('ray' in sys.modules, file=sys.stderr); raise\nprint('ray' in sys.modules, file=sys.stderr)\n"
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "BNRECAL_RAY_ADDRESS")}
    environment.update({"BNRECAL_MODEL_MODULES": "tests", "PYTHONPATH": str(ROOT), **(env or {})})
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=ROOT,
                          env=environment, timeout=300)


def test_the_cli_runs_one_worker_without_ray(mixed, tmp_path):
    model, samples, checkpoint, data = mixed
    out, report = tmp_path / "out.pt", tmp_path / "report.json"
    done = _cli("calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(checkpoint), "--data", str(data),
                "--batch-size", "6", "--order", "given", "--out", str(out), "--report", str(report))
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "False"  # Ray never imported
    written = json.loads(report.read_text())
    assert written["backend"] == "in-process" and written["world_size"] == 1
    recalibrated = perturbed(mixed_net())
    recalibrated.load_state_dict(torch.load(out, weights_only=True))
    assert_matches_reference(recalibrated, reference_statistics(model, samples, batch_size=6))


def test_a_program_whose_output_type_cannot_be_rebuilt_says_what_to_do(tmp_path):
    pytest.importorskip("transformers")
    from tests.hf import tiny_model

    program = tmp_path / "hf.pt2"
    model = tiny_model("ResNetForImageClassification")
    x = torch.randn(4, 3, 32, 32)
    torch.export.save(torch.export.export(model, (x,)), program)
    data = save_array(tmp_path / "x.npy", x)
    done = _cli("calibrate", "--program", str(program), "--data", str(data), "--out", str(tmp_path / "out.pt2"))
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[0]
    assert "returns a transformers.modeling_outputs.ImageClassifierOutputWithNoAttention" in line
    assert "return_dict=False" in line and "cannot be deserialized by this torch" not in line
