"""`bnrecal submit` as careful as the web page (issue 33): the spec is checked before any byte
is sent, a file the server has is never sent again (counted in /metrics), the job id is
the one line on stdout; data the model rejects is refused at submission, naming ``data``;
`bnrecal jobs` is a table (and JSON)."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from tests.api.conftest import KEYS, upload, wait_for, write_samples
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("ray_cluster")

KEY = KEYS["submit"]


def uploaded_bytes(live_server) -> float:
    with live_server.client(None) as client:
        text = client.get("/metrics").text
    return float(re.search(r"^bnrecal_upload_bytes_total (\S+)$", text, re.M).group(1))


def digest(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def has_blob(live_server, path: Path) -> bool:
    with live_server.client("submit") as client:
        return client.head(f"/v1/blobs/{digest(path)}").status_code == 200


@pytest.fixture
def files(tmp_path: Path, stale_checkpoint) -> dict[str, Path]:
    data, _ = write_samples(tmp_path / "calib.npy", 12, seed=int.from_bytes(tmp_path.name.encode()[-4:], "big"))
    return {"checkpoint": stale_checkpoint(), "data": data}


def submit_args(live_server, files: dict[str, Path], out: Path, arch: str = "tests.nets:mixed_net") -> list[str]:
    return ["submit", "--server", live_server.url, "--api-key", KEY, "--arch", arch,
            "--checkpoint", str(files["checkpoint"]), "--data", str(files["data"]),
            "--workers", "1", "--batch-size", "4", "--out", str(out)]


@pytest.mark.parametrize("arch, suggestion", [
    ("torchvison:resnet18", "did you mean torchvision:resnet18?"),
    ("test.nets:mixed_net", "did you mean tests.nets:mixed_net?"),
])
def test_a_mistyped_arch_sends_no_byte_and_suggests(live_server, files, tmp_path, capsys, arch, suggestion):
    before = uploaded_bytes(live_server)
    code, out, err = run_cli(capsys, *submit_args(live_server, files, tmp_path / "out.pt", arch))
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and err.startswith("error: ") and suggestion in err
    assert uploaded_bytes(live_server) == before
    assert not has_blob(live_server, files["checkpoint"]) and not has_blob(live_server, files["data"])


def test_the_spec_is_typed_here_a_field_the_server_refuses_is_refused_before_it_is_asked(files, tmp_path, capsys):
    """submit builds the server's own JobSpec: a field out of its range is refused (exit 2,
    naming it) without a request, so nothing listening at --server is needed to say so."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{probe.getsockname()[1]}"  # closed again: nothing listens there
    args = ["submit", "--server", nowhere, "--api-key", KEY, "--arch", "tests.nets:mixed_net", "--checkpoint",
            str(files["checkpoint"]), "--data", str(files["data"]), "--out", str(tmp_path / "out.pt"),
            "--onnx", str(tmp_path / "m.onnx"), "--onnx-opset", "99"]
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == "", err
    assert err.startswith("error: --onnx-opset: ") and "23" in err and err.count("\n") == 1


def test_a_second_submit_uploads_nothing_and_stdout_is_the_job_id(live_server, files, tmp_path, capsys):
    sizes = files["checkpoint"].stat().st_size + files["data"].stat().st_size
    before = uploaded_bytes(live_server)
    code, out, err = run_cli(capsys, *submit_args(live_server, files, tmp_path / "first.pt"))
    assert code == 0, err
    first = out.strip()
    assert out == f"{first}\n" and f"job {first} queued" in err  # one line on stdout: JOB=$(bnrecal submit ...)
    assert uploaded_bytes(live_server) - before == sizes

    middle = uploaded_bytes(live_server)
    code, out, err = run_cli(capsys, *submit_args(live_server, files, tmp_path / "second.pt"))
    assert code == 0, err
    second = out.strip()
    assert second != first and uploaded_bytes(live_server) == middle  # 0 bytes the second time
    assert (tmp_path / "first.pt").read_bytes() == (tmp_path / "second.pt").read_bytes()

    code, out, _ = run_cli(capsys, "jobs", "--server", live_server.url, "--api-key", KEY, "--limit", "2")
    header, *rows = out.splitlines()
    assert header.split() == ["ID", "STATUS", "PHASE", "OR", "RESULT", "CREATED", "MODEL", "DATA"]
    assert [row.split()[:2] for row in rows] == [[second, "succeeded"], [first, "succeeded"]]
    created = rows[0].split()[4]
    assert datetime.fromisoformat(created).tzinfo is not None  # ISO 8601 with the zone
    assert "12 samples" in rows[0] and "tests.nets:mixed_net" in rows[0] and "calib.npy" in rows[0]

    code, out, _ = run_cli(capsys, "jobs", "--server", live_server.url, "--api-key", KEY, "--limit", "2", "--json")
    assert code == 0 and [job["id"] for job in json.loads(out)] == [second, first]
    created = rows[1].split()[4]
    code, out, _ = run_cli(capsys, "status", first, "--server", live_server.url, "--api-key", KEY)
    assert code == 0 and f"created {created}" in out and "data calib.npy" in out


def test_submit_with_mlflow_logs_the_jobs_run_from_what_it_brought_back(live_server, files, tmp_path, capsys,
                                                                        monkeypatch):
    """``submit --mlflow`` logs as ``calibrate --mlflow`` does (tests/service/test_tracking.py),
    from the files and report the job brought back; here into MLflow's file store."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    code, out, err = run_cli(capsys, *submit_args(live_server, files, tmp_path / "out.pt"), "--mlflow")
    assert code == 0, err
    [run] = mlflow.MlflowClient().search_runs(["0"])
    assert f"logged MLflow run {run.info.run_id}" in err and run.info.status == "FINISHED"
    assert run.data.params["workers"] == "1" and run.data.metrics["samples"] == 12
    assert sorted(a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)) == [
        "out.pt", "report.html", "report.json"]
    assert not (tmp_path / "report.json").exists()  # not asked for: written for the run only


def test_channels_last_data_is_refused_at_submission_naming_data(live_server, files, tmp_path, capsys):
    channels_last = tmp_path / "nhwc.npy"
    np.save(channels_last, np.load(files["data"]).transpose(0, 2, 3, 1).copy())  # (N, 6, 5, 3)
    with live_server.client("submit") as client:
        spec = {"arch": "tests.nets:mixed_net", "checkpoint": upload(client, files["checkpoint"]),
                "data": upload(client, channels_last), "workers": 1, "batch_size": 4}
        for params in ({"dry_run": "true"}, {}):
            response = client.post("/v1/jobs", json=spec, params=params)
            assert response.status_code == 422, response.text
            problem = response.json()
            assert problem["field"] == "data" and problem["title"] == "Data does not fit the model"
            assert "rejects samples of shape (6, 5, 3): it takes (3, H, W); your data looks channels-last" in problem["detail"]
            assert "x.transpose(0, 3, 1, 2)" in problem["detail"]
        assert client.get("/v1/jobs").json()["jobs"] == [] or all(
            job["spec"]["data"] != spec["data"] for job in client.get("/v1/jobs").json()["jobs"]
        )
    # The command line shows the same as its one line, exit 2.
    files = {**files, "data": channels_last}
    code, out, err = run_cli(capsys, *submit_args(live_server, files, tmp_path / "out.pt"))
    assert code == 2 and out == "" and err.count("\n") == 1 and "channels-last" in err


def test_a_failed_jobs_problem_names_the_field_at_fault(live_server, files, tmp_path):
    truncated = tmp_path / "truncated.npy"
    whole = files["data"].read_bytes()
    truncated.write_bytes(whole[: len(whole) - 40])  # a header that promises more rows than there are
    with live_server.client("submit") as client:
        spec = {"arch": "tests.nets:mixed_net", "checkpoint": upload(client, files["checkpoint"]),
                "data": upload(client, truncated), "workers": 1, "batch_size": 4}
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 202, response.text
        job = wait_for(client, response.json()["id"], ("failed",))
    assert job["error"]["field"] == "data" and "truncated" in job["error"]["detail"]


def test_each_phase_is_one_event(live_server, files):
    from bnrecal.service.client import parse_events

    with live_server.client("submit") as client:
        spec = {"arch": "tests.nets:mixed_net", "checkpoint": upload(client, files["checkpoint"]),
                "data": upload(client, files["data"]), "workers": 1, "batch_size": 4, "outputs": ["checkpoint", "onnx"]}
        job = client.post("/v1/jobs", json=spec).json()
        with client.stream("GET", f"/v1/jobs/{job['id']}/events") as response:
            events = [event.data for event in parse_events(response.iter_lines())]
    assert events[-1]["status"] == "succeeded"
    states = [(event["status"], event["progress"]["phase"], event["progress"]["samples_done"],
               event["progress"]["samples_total"]) for event in events]
    assert all(a != b for a, b in zip(states, states[1:])), states  # no event repeats the one before
    phases = [phase for status, phase, _, _ in states if status == "running"]  # the final status event aside
    assert phases.count("starting workers") <= 1 and phases.count("exporting") <= 1 and phases.count("writing") <= 1
    entered = [phase for index, phase in enumerate(phases) if index == 0 or phases[index - 1] != phase]
    assert len(entered) == len(set(entered)), entered  # a phase, once left, never comes back


@pytest.mark.parametrize("layout", ["tar shards", "parquet"])
def test_submit_sends_a_folder_of_shards_read_as_shards(live_server, tmp_path, capsys, monkeypatch, layout):
    """A local folder of WebDataset shards or of Parquet files (as the Hub lays them out) goes up
    as one tar and is read on the server as the shards it holds: the same checkpoint as the
    same photos calibrated from a folder of images here."""
    import torch

    from tests.conftest import save_state
    from tests.nets import classifier_net, perturbed
    from tests.shards import folder_order, photos, write_folder, write_parquet, write_tar_shards

    items = folder_order(photos(10, size=32))
    write_folder(tmp_path / "photos", items)
    shards = tmp_path / "shards"
    if layout == "tar shards":
        write_tar_shards(shards, items, 4)
    else:
        write_parquet(shards, items, 6, row_group=3)
    torch.manual_seed(1)
    checkpoint = save_state(tmp_path / "m.pt", perturbed(classifier_net(3)))
    common = ["--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 3}', "--checkpoint", str(checkpoint),
              "--transform", '{"resize": 20, "crop": 16}', "--batch-size", "4", "--order", "given"]
    code, _, err = run_cli(capsys, "submit", "--server", live_server.url, "--api-key", KEY, *common,
                           "--data", str(shards), "--out", str(tmp_path / "remote.pt"),
                           "--report", str(tmp_path / "remote.json"))
    assert code == 0, err
    report = json.loads((tmp_path / "remote.json").read_text())
    assert report["dataset"]["kind"] == "shards" and report["samples"] == 10
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    monkeypatch.setenv("BNRECAL_DATA_DIR", str(tmp_path / "state"))
    code, _, err = run_cli(capsys, "calibrate", *common, "--data", str(tmp_path / "photos"),
                           "--out", str(tmp_path / "local.pt"))
    assert code == 0, err
    remote, local = torch.load(tmp_path / "remote.pt"), torch.load(tmp_path / "local.pt")
    assert all(torch.equal(remote[key], local[key]) for key in local)
