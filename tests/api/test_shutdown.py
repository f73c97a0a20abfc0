"""SIGTERM is a gentle shutdown of ``bnrecal serve`` (a real process on its own Ray).

New uploads and jobs get 503 at once while reads, downloads and readiness keep
answering (readiness with 503, so a load balancer moves on); a running job that ends
within ``BNRECAL_SHUTDOWN_GRACE_S`` succeeds with its artifacts; one that does not goes
back to the queue, unfinished and without artifacts, and runs after the restart; a
queued job is not started by the server that is going away.
"""

from __future__ import annotations

import hashlib
import json
import signal
import threading
import time

import httpx
import pytest
import torch

from bnrecal.service.jobserver.records.views import JobStatus
from bnrecal.service.jobserver.ledger import Ledger, sqlite_url
from tests.api.conftest import submit, upload, wait_for
from tests.api.server_process import ServerProcess, servers  # noqa: F401 - servers is a fixture
from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net

GRACE_S = 10.0
SLOW_S = 3.0  # the job that finishes: its rank sleeps this long on the marked sample


def follow(client: httpx.Client, job_id: str, events: list[dict], ended: threading.Event) -> None:
    """Collect a job's Server-Sent Events until the server ends the stream."""
    try:
        with client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
    except httpx.HTTPError:
        pass
    finally:
        ended.set()


@pytest.mark.slow  # two server starts and a grace period: ~45 s
def test_sigterm_drains_then_requeues(servers, tmp_path):  # noqa: F811 - servers is the imported fixture
    data_dir = tmp_path / "data"
    env = {"BNRECAL_SHUTDOWN_GRACE_S": str(GRACE_S), "BNRECAL_CPUS_PER_WORKER": "1",
           "BNRECAL_MAX_CONCURRENT_JOBS": "2"}
    server = ServerProcess(data_dir, tmp_path / "server.log", env=env)
    servers.append(server)
    client = server.client

    samples = torch.randn(16, 4)
    samples[5, 0] = MARKER
    data = upload(client, save_array(tmp_path / "x.npy", samples))

    def spec(name: str, **kwargs: object) -> dict:
        checkpoint = upload(client, save_state(tmp_path / f"{name}.pt", marker_net(**kwargs)))
        return {"arch": "tests.nets:marker_net", "model_kwargs": kwargs, "checkpoint": checkpoint,
                "data": data, "batch_size": 4, "order": "given", "workers": 1}

    slow = submit(client, spec("slow", action="hang", hang_s=SLOW_S))
    stuck = submit(client, spec("stuck", action="hang"))
    slow = wait_for(client, slow["id"], ("running",), progressed=True)
    stuck = wait_for(client, stuck["id"], ("running",), progressed=True)
    plain_data = upload(client, save_array(tmp_path / "plain.npy", torch.randn(8, 4)))
    waiting = submit(client, spec("plain", action="exit") | {"data": plain_data})
    assert client.get(f"/v1/jobs/{waiting['id']}").json()["status"] == "queued"
    events: list[dict] = []
    stream_ended = threading.Event()
    follower = threading.Thread(target=follow, args=(server.client, stuck["id"], events, stream_ended), daemon=True)
    follower.start()
    time.sleep(0.5)

    late = spec("late", action="exit")
    server.process.terminate()
    signalled = time.monotonic()
    time.sleep(0.3)
    refused = client.post("/v1/jobs", json=late)
    assert refused.status_code == 503, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.headers["retry-after"].isdigit()
    assert "shutting down" in refused.json()["detail"]
    upload_refused = client.post("/v1/blobs", content=b"late bytes")
    assert upload_refused.status_code == 503 and "shutting down" in upload_refused.json()["detail"]
    ready = client.get("/readyz")
    assert ready.status_code == 503 and "shutting down" in ready.json()["detail"]
    assert client.get("/healthz").status_code == 200
    assert client.get(f"/v1/jobs/{waiting['id']}").json()["status"] == "queued"

    finished = wait_for(client, slow["id"], ("succeeded",), timeout=GRACE_S)
    artifact = client.get(f"/v1/jobs/{slow['id']}/artifacts/checkpoint")
    assert artifact.status_code == 200
    assert artifact.headers["etag"] == f'"sha256:{hashlib.sha256(artifact.content).hexdigest()}"'
    assert finished["artifacts"]["checkpoint"]["digest"] == f"sha256:{hashlib.sha256(artifact.content).hexdigest()}"

    server.process.wait(GRACE_S + 60)
    stopped_after = time.monotonic() - signalled
    assert GRACE_S - 0.5 <= stopped_after <= GRACE_S + 20, stopped_after
    assert stream_ended.wait(5)
    assert events and events[-1]["status"] == "queued", events[-3:]

    ledger = Ledger(sqlite_url(data_dir))
    try:
        assert ledger.get_any(slow["id"]).status is JobStatus.succeeded
        requeued = ledger.get_any(stuck["id"])
        assert requeued.status is JobStatus.queued and requeued.attempts == 0 and not requeued.artifacts
        assert ledger.get_any(waiting["id"]).status is JobStatus.queued
        assert ledger.get_any(waiting["id"]).attempts == 0
    finally:
        ledger.close()

    # The restarted server runs what was left: the queued job succeeds, the stuck one runs again.
    server = ServerProcess(data_dir, tmp_path / "server.log", env=env)
    servers.append(server)
    assert wait_for(server.client, waiting["id"], ("succeeded",))["attempts"] == 1
    assert wait_for(server.client, stuck["id"], ("running",), progressed=True)["attempts"] == 1
    assert server.client.get(f"/v1/jobs/{stuck['id']}/artifacts/checkpoint").status_code == 409
    assert server.client.post(f"/v1/jobs/{stuck['id']}/cancel").status_code == 202
    assert wait_for(server.client, stuck["id"], ("cancelled",), timeout=10)["status"] == "cancelled"

    # Ctrl-C stops it at once, with the code a shell reports for it (not a KeyboardInterrupt's
    # traceback and the interpreter's teardown after uvicorn raises the signal again).
    said_before = (tmp_path / "server.log").stat().st_size
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(30) == 128 + signal.SIGINT
    said = (tmp_path / "server.log").read_bytes()[said_before:].decode(errors="replace")
    assert "Traceback" not in said, said
