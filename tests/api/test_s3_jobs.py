"""Jobs on data in object storage over HTTP and from the CLI: ``data: {"uri": "s3://..."}``
read by the server under ``BNRECAL_DATA_URIS`` only, from a local moto S3 server."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.api.conftest import KEYS, submit, upload, wait_for, write_samples
from tests.conftest import run_cli
from tests.s3 import S3Server

pytestmark = pytest.mark.usefixtures("ray_cluster")
BUCKET = "api-data"


@pytest.fixture
def s3_settings(live_server, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The live server reads s3://api-data/allowed/ from the test S3 server."""
    settings = live_server.services.settings  # the service's copy, which the runner shares
    assert live_server.services.runner.settings is settings
    monkeypatch.setattr(settings, "data_uris", [f"s3://{BUCKET}/allowed"])
    monkeypatch.setattr(settings, "s3_endpoint_url", s3_server.endpoint)
    return s3_server


@pytest.fixture(scope="module")
def checkpoint(stale_checkpoint) -> Path:
    return stale_checkpoint()


def spec_for(digest: str, data: object, **extra: object) -> dict:
    return {"arch": "tests.nets:mixed_net", "checkpoint": digest, "data": data, "workers": 2, "batch_size": 4, **extra}


@pytest.mark.parametrize(
    "uri, message",
    [
        (f"s3://{BUCKET}/elsewhere/x.npy", "outside the server's allowed prefixes (BNRECAL_DATA_URIS)"),
        (f"s3://{BUCKET}/allowedX/x.npy", "outside the server's allowed prefixes (BNRECAL_DATA_URIS)"),
        (f"s3://AKIA:secret@{BUCKET}/allowed/x.npy", "must not carry credentials"),
        (f"s3://{BUCKET}/allowed/x.npy?X-Amz-Credential=AKIA", "must not have a query string"),
        (f"https://{BUCKET}.s3.amazonaws.com/allowed/x.npy", "not supported"),
    ],
)
def test_uris_outside_the_allowlist_or_unsafe_are_422(live_server, s3_settings, checkpoint, uri, message):
    with live_server.client("s3") as client:
        response = client.post("/v1/jobs", json=spec_for(upload(client, checkpoint), {"uri": uri}))
        evaluation = client.post(
            "/v1/jobs", json=spec_for(upload(client, checkpoint), {"uri": f"s3://{BUCKET}/allowed/x.npy"},
                                      eval={"data": {"uri": uri}}))
    assert response.status_code == 422 and response.json()["field"] == "data.uri"
    assert message in response.json()["detail"]
    assert evaluation.status_code == 422 and evaluation.json()["field"] == "eval.data.uri"


def test_no_object_storage_without_the_setting_and_no_credentials_in_the_spec(live_server, checkpoint):
    with live_server.client("s3") as client:
        digest = upload(client, checkpoint)
        refused = client.post("/v1/jobs", json=spec_for(digest, {"uri": f"s3://{BUCKET}/allowed/x.npy"}))
        extra = client.post("/v1/jobs", json=spec_for(digest, {"uri": f"s3://{BUCKET}/allowed/x.npy",
                                                               "aws_secret_access_key": "x"}))
    assert refused.status_code == 422 and "BNRECAL_DATA_URIS" in refused.json()["detail"]
    assert extra.status_code == 422


def test_a_job_on_s3_data_with_s3_evaluation(live_server, s3_settings, checkpoint, tmp_path):
    server = s3_settings
    data, samples = write_samples(tmp_path / "x.npy", 30, seed=3)
    buffer = io.BytesIO()
    np.savez(buffer, x=samples[:12].numpy(), y=(torch.arange(12) % 4).numpy())
    uri = server.put(BUCKET, "allowed/calib/x.npy", data)
    eval_uri = server.put(BUCKET, "allowed/eval/labelled.npz", buffer.getvalue())
    with live_server.client("s3") as client:
        digest = upload(client, checkpoint)
        job = submit(client, spec_for(digest, {"uri": uri}, eval={"data": {"uri": eval_uri}}))
        done = wait_for(client, job["id"], timeout=300)
        local = submit(client, spec_for(digest, upload(client, data)))
        local_done = wait_for(client, local["id"], timeout=300)
        missing = submit(client, spec_for(digest, {"uri": f"s3://{BUCKET}/allowed/missing.npy"}))
        failed = wait_for(client, missing["id"], timeout=120)
    assert done["status"] == "succeeded", done["error"]
    report = done["report"]
    assert report["data_transport"] == "remote" and report["samples"] == 30 and report["object_store_bytes"] == 0
    assert report["evaluation"]["labelled"] and report["evaluation"]["samples"] == 12
    assert done["spec"]["data"] == {"uri": uri}
    drift = {layer["name"]: round(layer["mean_shift"], 5) for layer in report["layers"]}
    assert drift == {layer["name"]: round(layer["mean_shift"], 5) for layer in local_done["report"]["layers"]}
    assert failed["status"] == "failed" and failed["error"]["status"] == 422
    assert failed["error"]["detail"] == f"calibration data not found: s3://{BUCKET}/allowed/missing.npy"


def test_cli_submit_sends_the_uri_and_the_refusal_is_one_line(live_server, s3_settings, checkpoint, capsys):
    code, out, err = run_cli(
        capsys, "submit", "--server", live_server.url, "--api-key", KEYS["s3"], "--arch", "tests.nets:mixed_net",
        "--checkpoint", str(checkpoint), "--data", f"s3://{BUCKET}/private/x.npy", "--out", "unused.pt",
    )
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "BNRECAL_DATA_URIS" in err


def test_cli_calibrate_refuses_unsafe_uris_and_names_missing_keys(
    s3_server: S3Server, checkpoint, capsys, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    monkeypatch.setenv("BNRECAL_S3_ENDPOINT_URL", s3_server.endpoint)  # no allowlist: the operator's own tool
    s3_server.bucket(BUCKET)
    base = ["calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o.pt")]
    code, _, err = run_cli(capsys, *base, "--data", f"s3://key:secret@{BUCKET}/x.npy")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--data must not carry credentials" in err
    code, _, err = run_cli(capsys, *base, "--data", "s3://no-such-bucket-here/x.npy")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not found: s3://no-such-bucket-here/x.npy" in err
