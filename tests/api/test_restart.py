"""``bnrecal serve`` as a real process: killed (SIGKILL) while a job runs, then restarted.

Finished jobs and their artifacts are still served; the interrupted job is run again
from scratch once, and failed with "interrupted by restart" when a second crash
interrupts it too. Also: a large upload does not grow the server's memory.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bnrecal.service.jobserver.records.views import JobStatus
from bnrecal.service.jobserver.ledger import Ledger, sqlite_url
from tests.api.conftest import submit, upload, wait_for, write_samples
from tests.api.server_process import ServerProcess, servers  # noqa: F401 - servers is a fixture
from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net, mixed_net


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow  # three server starts and three jobs: ~80 s on a busy 2-core machine
def test_crash_while_running_then_restart(servers, tmp_path):
    data_dir = tmp_path / "data"
    log = tmp_path / "server.log"
    server = ServerProcess(data_dir, log)
    servers.append(server)
    client = server.client

    spec = {
        "arch": "tests.nets:mixed_net",
        "checkpoint": upload(client, save_state(tmp_path / "m.pt", mixed_net())),
        "data": upload(client, write_samples(tmp_path / "x.npy", 8)[0]),
    }
    done = wait_for(client, submit(client, spec)["id"])
    assert done["status"] == "succeeded", done["error"]
    artifact = client.get(f"/v1/jobs/{done['id']}/artifacts/checkpoint")

    samples = torch.randn(40, 4)
    samples[5, 0] = MARKER
    hang = {
        "arch": "tests.nets:marker_net",
        "model_kwargs": {"action": "hang"},
        "checkpoint": upload(client, save_state(tmp_path / "k.pt", marker_net())),
        "data": upload(client, save_array(tmp_path / "k.npy", samples)),
        "batch_size": 4, "order": "given",
    }
    interrupted = wait_for(client, submit(client, hang)["id"], ("running",), progressed=True)
    server.crash()

    server = ServerProcess(data_dir, log)
    servers.append(server)
    client = server.client
    again = client.get(f"/v1/jobs/{done['id']}").json()
    assert again["status"] == "succeeded" and again["report"] == done["report"]
    download = client.get(f"/v1/jobs/{done['id']}/artifacts/checkpoint")
    assert download.content == artifact.content and download.headers["etag"] == artifact.headers["etag"]
    assert download.headers["etag"] == f'"sha256:{hashlib.sha256(download.content).hexdigest()}"'

    rerun = wait_for(client, interrupted["id"], ("running",), progressed=True)
    assert rerun["attempts"] == 2 and rerun["started_at"] > interrupted["started_at"]
    server.crash()

    # No shutdown grace: SIGTERM puts a running job straight back (test_shutdown waits it out).
    server = ServerProcess(data_dir, log, env={"BNRECAL_SHUTDOWN_GRACE_S": "0"})
    servers.append(server)
    failed = server.client.get(f"/v1/jobs/{interrupted['id']}").json()
    assert failed["status"] == "failed" and "interrupted by restart" in failed["error"]["detail"]
    listed = server.client.get("/v1/jobs").json()["jobs"]
    assert not [job for job in listed if job["status"] == "running"]
    assert not list((data_dir / "blobs" / ".staging").iterdir())

    # A clean shutdown (SIGTERM) puts a running job back in the queue, its attempt not counted.
    stopped = wait_for(server.client, submit(server.client, hang)["id"], ("running",), progressed=True)
    server.process.terminate()
    server.process.wait(60)  # uvicorn re-raises SIGTERM after its clean shutdown: the status says -15
    ledger = Ledger(sqlite_url(data_dir))
    requeued = ledger.get_any(stopped["id"])
    ledger.close()
    assert requeued.status is JobStatus.queued and requeued.attempts == 0


def test_large_upload_keeps_server_memory_flat(servers, tmp_path):
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    servers.append(server)
    size = 128 * 1024 * 1024  # held whole, it would be well past the 48 MiB allowed below
    block = os.urandom(1024 * 1024)
    digest = hashlib.sha256()
    peak = [rss_bytes(server.process.pid)]
    baseline = peak[0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes(server.process.pid))
            time.sleep(0.02)

    def body() -> Iterator[bytes]:
        for _ in range(size // len(block)):
            digest.update(block)
            yield block

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        response = server.client.post("/v1/blobs", content=body(), timeout=300)
    finally:
        stop.set()
        sampler.join()
    assert response.status_code == 201
    assert response.json() == {"digest": f"sha256:{digest.hexdigest()}", "size": size, "filename": None}
    assert peak[0] - baseline < 48 * 1024 * 1024, f"server grew by {(peak[0] - baseline) >> 20} MiB"
