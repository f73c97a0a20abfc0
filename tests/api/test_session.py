"""The full session against the live server: upload, submit, follow the events, download.

The downloaded checkpoint must hold what the engine computes for the same inputs, and
match the independent float64 reference.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file, save_file

from bnrecal.service.cli import main
from bnrecal.service.client import BnrecalClient, parse_events
from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.api.conftest import KEYS, submit, upload, write_samples
from tests.nets import mixed_net
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics

pytestmark = pytest.mark.usefixtures("ray_cluster")

BATCH = 6


@pytest.fixture(scope="module")
def session_inputs(tmp_path_factory, small_model):
    folder = tmp_path_factory.mktemp("session")
    checkpoint = folder / "model.safetensors"
    save_file(small_model.state_dict(), str(checkpoint), metadata={"epoch": "7"})
    data, samples = write_samples(folder / "calib.npy", 23)
    return checkpoint, data, samples


@pytest.fixture(scope="module")
def finished(live_server, session_inputs):
    """One job run through the API, followed over SSE to its end."""
    checkpoint, data, _ = session_inputs
    with live_server.client("alice") as client:
        spec = {
            "arch": "tests.nets:mixed_net",
            "checkpoint": upload(client, checkpoint),
            "data": upload(client, data),
            "workers": 2,
            "batch_size": BATCH,
            "outputs": ["checkpoint", "onnx"],
        }
        job = submit(client, spec)
        with client.stream("GET", f"/v1/jobs/{job['id']}/events") as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = list(parse_events(response.iter_lines()))
        final = client.get(f"/v1/jobs/{job['id']}").json()
    return spec, events, final


def test_events_stream_to_the_terminal_status(finished):
    _, events, final = finished
    ids = [event.id for event in events]
    assert ids == sorted(set(ids)), "event ids must increase"
    assert events[-1].kind == "status" and events[-1].data["status"] == "succeeded"
    assert final["status"] == "succeeded", final["error"]
    statuses = [event.data["status"] for event in events]
    assert "running" in statuses and all(s in ("queued", "running", "succeeded") for s in statuses)
    assert events[-1].data["progress"]["samples_done"] == events[-1].data["progress"]["samples_total"] == 23
    phases = [event.data["progress"]["phase"] for event in events]
    order = [None, "starting workers", "calibrating", "exporting", "writing"]
    assert phases == sorted(phases, key=order.index) and phases[-1] == "writing"
    counts: dict[str, list[tuple[int, int | None]]] = {}
    for event in events:  # the feed may merge updates: what is seen must be consistent, not complete
        progress = event.data["progress"]
        counts.setdefault(progress["phase"], []).append((progress["samples_done"], progress["samples_total"]))
    assert all(total in (None, 23) and done == 0 for done, total in counts.get("starting workers", []))
    assert all(total == 23 for _, total in counts["calibrating"])  # the total is known from the job's start
    for phase in ("starting workers", "calibrating"):
        seen = [done for done, _ in counts.get(phase, [])]
        assert seen == sorted(seen), phase


def test_downloaded_checkpoint_is_the_engines_result_in_the_uploaded_format(
    finished, live_server, session_inputs, small_model, settings, tmp_path
):
    spec, _, final = finished
    checkpoint, data, samples = session_inputs
    artifact = final["artifacts"]["checkpoint"]
    with live_server.client("alice") as client:
        response = client.get(f"/v1/jobs/{final['id']}/artifacts/checkpoint")
    assert response.status_code == 200
    assert response.headers["etag"] == f'"{artifact["digest"]}"'
    assert artifact["digest"] == "sha256:" + hashlib.sha256(response.content).hexdigest()
    assert artifact["filename"].endswith(".safetensors")
    downloaded = load_file_bytes(response.content, tmp_path / "downloaded.safetensors")

    engine = recalibrate(
        RecalibrationRequest(arch=spec["arch"], checkpoint=checkpoint, data=data, workers=2, batch_size=BATCH),
        settings,
    )
    expected = engine.model.state_dict()
    original = small_model.state_dict()
    assert downloaded.keys() == original.keys()
    for key, value in downloaded.items():
        assert value.dtype == original[key].dtype and value.shape == original[key].shape
        if key.endswith(("running_mean", "running_var")):
            torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7)
        elif key.endswith("num_batches_tracked"):
            assert value.item() == original[key].item() + 4  # ceil(23 / 6) steps
        else:
            assert torch.equal(value, original[key]), key
    model = mixed_net()
    model.load_state_dict(downloaded)
    assert_matches_reference(model, reference_statistics(small_model, in_contract_order(samples), batch_size=BATCH))
    report = final["report"]
    assert report["samples"] == engine.report["samples"] == 23
    assert report["world_size"] == 2 and report["steps"] == 4
    assert [layer["name"] for layer in report["layers"]] == [layer["name"] for layer in engine.report["layers"]]


def load_file_bytes(content: bytes, path):
    path.write_bytes(content)
    return load_file(str(path))


def test_onnx_and_report_artifacts(finished, live_server, session_inputs, tmp_path):
    _, _, final = finished
    _, _, samples = session_inputs
    with live_server.client("alice") as client:
        onnx_bytes = client.get(f"/v1/jobs/{final['id']}/artifacts/onnx").content
        report = client.get(f"/v1/jobs/{final['id']}/artifacts/report").json()
        weights = client.get(f"/v1/jobs/{final['id']}/artifacts/checkpoint").content
        page = client.get(f"/v1/jobs/{final['id']}/artifacts/report.html")
    assert report == final["report"]
    assert page.headers["content-type"].startswith("text/html")
    assert "<svg" in page.text and "http" not in page.text
    assert all(layer["name"] in page.text for layer in report["layers"])
    assert report["onnx"]["batchnorm_nodes"] < 5  # folding happened
    session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    model = mixed_net()
    model.load_state_dict(load_file_bytes(weights, tmp_path / "weights.safetensors"))
    model.eval()
    batch = samples[:5]
    (got,) = session.run(None, {session.get_inputs()[0].name: batch.numpy()})
    np.testing.assert_allclose(got, model(batch).detach().numpy(), atol=1e-4)


def test_conditional_and_head_requests(finished, live_server, session_inputs):
    _, _, final = finished
    checkpoint, _, _ = session_inputs
    digest = final["spec"]["checkpoint"]
    with live_server.client("alice") as client:
        head = client.head(f"/v1/blobs/{digest}")
        assert head.status_code == 200 and head.content == b""
        assert int(head.headers["content-length"]) == checkpoint.stat().st_size
        assert head.headers["etag"] == f'"{digest}"'
        again = client.get(f"/v1/blobs/{digest}", headers={"If-None-Match": f'"{digest}"'})
        assert again.status_code == 304 and again.content == b""
        assert client.get(f"/v1/blobs/{digest}").content == checkpoint.read_bytes()


def test_resuming_events_sends_only_what_is_newer(finished, live_server):
    _, events, final = finished
    with live_server.client("alice") as client:
        def resume(last_id):
            with client.stream("GET", f"/v1/jobs/{final['id']}/events", headers={"Last-Event-ID": str(last_id)}) as r:
                return list(parse_events(r.iter_lines()))

        assert resume(events[-1].id) == []
        resumed = resume(events[0].id)
        assert [e.id for e in resumed] == [events[-1].id] and resumed[0].data["status"] == "succeeded"


def test_metrics_count_jobs_samples_and_uploads(finished, live_server, session_inputs):
    with live_server.client(None) as client:
        text = client.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    checkpoint, data, _ = session_inputs
    assert values['bnrecal_jobs{status="succeeded"}'] >= 1
    assert values["bnrecal_samples_processed_total"] >= 23
    assert values["bnrecal_upload_bytes_total"] >= checkpoint.stat().st_size + data.stat().st_size
    assert values['bnrecal_job_seconds_count{status="succeeded"}'] >= 1


def test_health_and_readiness(live_server):
    with live_server.client(None) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["ray"]["nodes"] >= 1


def test_submit_command_and_client_give_the_same_result(finished, live_server, session_inputs, tmp_path, capsys):
    _, _, final = finished
    checkpoint, data, _ = session_inputs
    out, report = tmp_path / "out.safetensors", tmp_path / "report.json"
    main([
        "submit", "--server", live_server.url, "--api-key", KEYS["alice"], "--arch", "tests.nets:mixed_net",
        "--checkpoint", str(checkpoint), "--data", str(data), "--workers", "2", "--batch-size", str(BATCH),
        "--placement", "pack", "--max-retries", "1", "--out", str(out), "--report", str(report),
    ])
    err = capsys.readouterr().err
    assert "recalibrated 5 BN layers on 23 samples" in err and f"-> {out}" in err
    assert f"also wrote {report}\n" in err  # every file written is listed
    submitted = json.loads(report.read_text())
    assert submitted["placement"] == "PACK" and submitted["attempts"] == 1
    with BnrecalClient(live_server.url, KEYS["alice"]) as client:
        first = client.download(final["id"], "checkpoint", tmp_path / "first.safetensors")
    ours, theirs = load_file(str(out)), load_file(str(first.path))
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-7)
    assert json.loads(report.read_text())["samples"] == 23
