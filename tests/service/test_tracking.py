"""Reports in MLflow (service/tracking.py, docs/training.md, "MLflow"): ``calibrate --mlflow`` and
``sweep --mlflow`` against a real tracking server process (SQLite backend, artifacts served
over HTTP), and the mistakes refused before any work. One-worker runs: in this process, no
Ray. The Python API's runs: tests/service/live/test_tracking.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlflow  # the mlflow extra is part of the test extra (pyproject.toml)
import pytest
import torch

from tests.conftest import run_cli, save_array, save_state
from tests.mlflow_server import free_port, mlflow_server
from tests.nets import mixed_net, no_norm_net, perturbed

REPO = Path(__file__).resolve().parents[2]



@pytest.fixture(scope="module")
def tracking_uri() -> str:
    with mlflow_server() as uri:
        yield uri


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tracking")
    for seed in range(2):
        torch.manual_seed(seed)
        save_state(folder / f"m{seed}.pt", perturbed(mixed_net(), seed))
    torch.manual_seed(9)
    save_array(folder / "a.npy", torch.randn(20, 3, 6, 5))
    save_array(folder / "wrong.npy", torch.randn(20, 5, 6, 5))  # channels the model does not take
    return folder


@pytest.fixture
def environment(monkeypatch, tmp_path, tracking_uri) -> None:
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    monkeypatch.setenv("BNRECAL_DATA_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("BNRECAL_DEBUG", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"bnrecal-{tmp_path.name}")  # each test its own experiment


def _runs(experiment_name: str) -> list:
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(experiment_name)
    return client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])


def _artifacts(run_id: str, path: str | None = None) -> list[str]:
    return sorted(item.path for item in mlflow.MlflowClient().list_artifacts(run_id, path))


@pytest.mark.usefixtures("environment")
def test_calibrate_logs_a_run_with_its_flags_figures_and_files(capsys, tmp_path, inputs):
    """One run: every flag as a param, the report's figures as metrics (the numbers of the
    report.json it logged), the files written and the report page as artifacts."""
    from bnrecal.service.run.report.document import Report
    from bnrecal.service.tracking import report_figures

    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(inputs / "m0.pt"),
        "--data", str(inputs / "a.npy"), "--batch-size", "8", "--out", str(tmp_path / "out.pt"),
        "--onnx", str(tmp_path / "m.onnx"), "--mlflow",
    )
    assert code == 0, err
    [run] = _runs(f"bnrecal-{tmp_path.name}")
    assert f"logged MLflow run {run.info.run_id}" in err
    assert run.info.status == "FINISHED" and run.info.run_name == "out.pt"
    params = run.data.params
    assert params["arch"] == "tests.nets:mixed_net" and params["batch_size"] == "8" and params["mode"] == "sync"
    assert params["data"] == str(inputs / "a.npy") and params["workers"] == "1" and "report" not in params
    assert _artifacts(run.info.run_id) == ["m.onnx", "out.pt", "report.html", "report.json"]
    logged = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="report.json",
                                                      dst_path=str(tmp_path / "down")))
    report = Report.model_validate_json(logged.read_text())
    assert run.data.metrics == pytest.approx(report_figures(report), rel=1e-12)
    assert run.data.metrics["bn_layers"] == len(report.layers) == 5 and run.data.metrics["samples"] == 20
    assert run.data.metrics["onnx_max_abs_diff"] == report.onnx.max_abs_diff
    downloaded = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="out.pt",
                                                     dst_path=str(tmp_path / "down"))
    assert Path(downloaded).read_bytes() == (tmp_path / "out.pt").read_bytes()


@pytest.mark.usefixtures("environment")
def test_a_job_that_fails_leaves_a_failed_run_saying_why(capsys, tmp_path, inputs):
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(inputs / "m0.pt"),
        "--data", str(inputs / "wrong.npy"), "--batch-size", "8", "--out", str(tmp_path / "out.pt"), "--mlflow",
    )
    assert code == 2 and err.startswith("error: ")
    [run] = _runs(f"bnrecal-{tmp_path.name}")
    assert run.info.status == "FAILED"
    assert run.data.tags["bnrecal.error"] in err and not (tmp_path / "out.pt").exists()


@pytest.mark.usefixtures("environment")
def test_a_sweep_is_a_parent_run_with_a_child_run_per_cell(capsys, tmp_path, inputs):
    save_state(tmp_path / "plain.pt", no_norm_net())
    manifest = tmp_path / "models.txt"
    manifest.write_text(f"{inputs / 'm0.pt'}\n"
                        f'{{"checkpoint": "plain.pt", "arch": "tests.nets:no_norm_net"}}\n'
                        f"{inputs / 'm1.pt'}\n")
    code, _, err = run_cli(
        capsys, "sweep", "--models", str(manifest), "--arch", "tests.nets:mixed_net",
        "--data", f"a={inputs / 'a.npy'}", "--batch-size", "8", "--out-dir", str(tmp_path / "out"), "--mlflow",
    )
    assert code == 1, err  # one cell failed: the sweep says so, and so do the runs
    parent, *children = _runs(f"bnrecal-{tmp_path.name}")
    assert parent.info.run_name == "sweep out" and parent.info.status == "FINISHED"
    assert parent.data.metrics["cells"] == 3 and parent.data.metrics["failed"] == 1
    assert _artifacts(parent.info.run_id) == ["sweep.csv", "sweep.html", "sweep.json"]
    assert [child.info.run_name for child in children] == ["m0/a", "plain/a", "m1/a"]
    assert all(child.data.tags["mlflow.parentRunId"] == parent.info.run_id for child in children)
    assert [child.info.status for child in children] == ["FINISHED", "FAILED", "FINISHED"]
    assert "BatchNorm" in children[1].data.tags["bnrecal.error"]
    for child, name in ((children[0], "m0"), (children[2], "m1")):
        assert child.data.params["model"] == name and child.data.params["set"] == "a"
        assert _artifacts(child.info.run_id) == [f"{name}.pt", "report.html", "report.json"]
        report = json.loads((tmp_path / "out" / name / "a" / "report.json").read_text())
        assert child.data.metrics["mean_shift_max"] == max(layer["mean_shift"] for layer in report["layers"])


def test_a_store_that_cannot_be_reached_is_refused_before_any_work(capsys, tmp_path, inputs, monkeypatch):
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(inputs / "m0.pt"),
        "--data", str(inputs / "a.npy"), "--out", str(tmp_path / "out.pt"), "--mlflow",
    )
    assert code == 2
    assert err.startswith("error: --mlflow: cannot log to MLflow at http://127.0.0.1:") and err.count("\n") == 1
    assert not (tmp_path / "out.pt").exists()


def test_without_mlflow_the_flag_says_what_to_install(tmp_path, inputs):
    code = ("import sys; sys.modules['mlflow'] = None\n"  # as where the mlflow extra is not installed
            "from bnrecal.service.cli import main; main(sys.argv[1:])")
    done = subprocess.run(
        [sys.executable, "-c", code, "calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint",
         str(inputs / "m0.pt"), "--data", str(inputs / "a.npy"), "--out", str(tmp_path / "out.pt"), "--mlflow"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "BNRECAL_MODEL_MODULES": "tests", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "error: --mlflow needs MLflow's client: pip install 'bnrecal[mlflow]'"
    assert not (tmp_path / "out.pt").exists()
