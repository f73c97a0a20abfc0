"""INT8 over HTTP: a job's ``onnx_int8`` output (here of a torch.export program exported at
a static batch of 1, calibrated by 2 ranks), downloadable with its digest; bad ``int8``
options refused at submission naming the field; ``bnrecal submit --onnx-int8``."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import pytest

from bnrecal.service.cli import main
from bnrecal.service.client import BnrecalClient
from tests.api.conftest import KEYS, upload
from tests.api.test_programs import team  # noqa: F401 - the module fixture: a team's program and data

pytestmark = pytest.mark.usefixtures("ray_cluster")

KEY = "programs"


def test_a_job_ships_a_checked_int8_model_of_a_program(live_server, team, tmp_path):  # noqa: F811
    _, samples, program, data = team
    np.savez(tmp_path / "labelled.npz", x=samples.numpy(), y=np.arange(len(samples)) % 3)
    with BnrecalClient(live_server.url, KEYS[KEY]) as client:
        spec = {
            "program": client.upload(program).digest, "data": client.upload(data).digest,
            "workers": 2, "batch_size": 8, "outputs": ["program", "onnx_int8"], "int8": {"method": "entropy"},
            "eval": {"data": client.upload(tmp_path / "labelled.npz").digest},
        }
        job = client.wait(client.submit(spec).id)
        assert job.status == "succeeded", job.error
        assert set(job.artifacts) == {"program", "onnx_int8", "report", "report.html"}
        client.download(job.id, "onnx_int8", tmp_path / "int8.onnx")
    payload = (tmp_path / "int8.onnx").read_bytes()
    assert job.artifacts["onnx_int8"].digest == "sha256:" + hashlib.sha256(payload).hexdigest()
    onnx.checker.check_model(onnx.load(tmp_path / "int8.onnx"), full_check=True)
    section = job.report["int8"]
    assert section["method"] == "entropy" and section["collectives"] == [2, 2] and section["samples"] == 30
    assert section["ops_quantized"].get("Conv") == 2
    assert set(section["evaluation"]) >= {"fp32", "int8", "stale_fp32", "stale_int8"}  # the stale program, alike


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"outputs": ["program", "onnx_int8"], "int8": {"method": "kl"}}, "int8.method"),
        ({"outputs": ["program", "onnx_int8"], "int8": {"max_top1_drop": 101}}, "int8.max_top1_drop"),
        ({"outputs": ["program", "onnx_int8"], "int8": {"keep": ["Conv"]}}, "int8.keep"),
        ({"outputs": ["program"], "int8": {"method": "entropy"}}, "int8"),
        ({"outputs": ["program", "onnx_int8"], "int8": {"max_top1_drop": 1}}, "int8.max_top1_drop"),  # no eval
    ],
)
def test_bad_int8_options_are_422_naming_the_field(live_server, team, change, field):  # noqa: F811
    _, _, program, data = team
    with live_server.client(KEY) as client:
        response = client.post("/v1/jobs", json={"program": upload(client, program), "data": upload(client, data)} | change)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["field"] == field


def test_submit_downloads_the_int8_model(live_server, team, tmp_path, capsys):  # noqa: F811
    _, _, program, data = team
    main([
        "submit", "--server", live_server.url, "--api-key", KEYS[KEY], "--program", str(program), "--data", str(data),
        "--workers", "2", "--batch-size", "8", "--out", str(tmp_path / "out.pt2"),
        "--onnx-int8", str(tmp_path / "int8.onnx"), "--int8", json.dumps({"per_channel": False}),
        "--report", str(tmp_path / "report.json"),
    ])
    err = capsys.readouterr().err
    assert "INT8" in err and str(tmp_path / "int8.onnx") in err
    section = json.loads((tmp_path / "report.json").read_text())["int8"]
    assert section["per_channel"] is False
    onnx.checker.check_model(onnx.load(tmp_path / "int8.onnx"), full_check=True)


def test_the_servers_int8_file_is_the_command_lines(live_server, team, tmp_path, capsys):  # noqa: F811
    """The same job over HTTP and on the command line writes the same INT8 file, byte for
    byte: the options' defaults (7-bit weights for the CPU targets) are one object's."""
    _, _, program, data = team
    common = ["--program", str(program), "--data", str(data), "--workers", "1", "--batch-size", "8",
              "--int8", json.dumps({"method": "percentile"})]
    main(["submit", "--server", live_server.url, "--api-key", KEYS[KEY], *common, "--out", str(tmp_path / "remote.pt2"),
          "--onnx-int8", str(tmp_path / "remote.onnx"), "--report", str(tmp_path / "remote.json")])
    main(["calibrate", *common, "--out", str(tmp_path / "local.pt2"), "--onnx-int8", str(tmp_path / "local.onnx"),
          "--report", str(tmp_path / "local.json")])
    capsys.readouterr()
    assert (tmp_path / "remote.onnx").read_bytes() == (tmp_path / "local.onnx").read_bytes()
    remote, local = (json.loads((tmp_path / f"{side}.json").read_text())["int8"] for side in ("remote", "local"))
    assert remote["reduce_range"] is local["reduce_range"] is True and remote["weights_why"] == local["weights_why"]


def test_a_guard_that_cannot_hold_leaves_the_checkpoint_fp32_export_and_report(live_server, tmp_path, capsys):
    """The INT8 output alone fails: the job succeeds without the onnx_int8 artifact, its report
    says why, and ``bnrecal submit`` downloads the rest, then exits 1 naming the guard."""
    from tests.service.export.int8_helpers import write_outlier_inputs

    inputs = write_outlier_inputs(tmp_path)
    with BnrecalClient(live_server.url, KEYS[KEY]) as client:
        spec = {
            "arch": "tests.service.export.int8_helpers:OutlierNet",
            "checkpoint": client.upload(inputs["checkpoint"]).digest, "data": client.upload(inputs["data"]).digest,
            "workers": 2, "batch_size": 32, "outputs": ["checkpoint", "onnx", "onnx_int8"],
            "int8": {"max_top1_drop": 0.5, "max_float_ops": 0},
            "eval": {"data": client.upload(inputs["eval"]).digest},
        }
        job = client.wait(client.submit(spec).id)
    assert job.status == "succeeded", job.error
    assert set(job.artifacts) == {"checkpoint", "onnx", "report", "report.html"}
    section = job.report["int8"]
    assert section["written"] is False and "max_top1_drop 0.5" in section["failure"]
    with pytest.raises(SystemExit) as exited:
        main([
            "submit", "--server", live_server.url, "--api-key", KEYS[KEY], "--arch", spec["arch"],
            "--checkpoint", str(inputs["checkpoint"]), "--data", str(inputs["data"]),
            "--eval-data", str(inputs["eval"]), "--workers", "2", "--batch-size", "32", "--out", str(tmp_path / "o.pt"),
            "--onnx-int8", str(tmp_path / "q.onnx"), "--int8", json.dumps(spec["int8"]),
            "--report", str(tmp_path / "r.json"),
        ])
    assert exited.value.code == 1
    assert (tmp_path / "o.pt").exists() and (tmp_path / "r.json").exists() and not (tmp_path / "q.onnx").exists()
    assert "max_top1_drop" in capsys.readouterr().err
