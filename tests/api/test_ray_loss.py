"""A dead Ray head is answered at once: ``bnrecal serve`` as a process of its own, with a
throwaway embedded Ray of its own (never the test session's), whose GCS process is killed
while a job runs. ``/readyz`` is 503 within 2 s, a submission is 503 with ``Retry-After`` at
once, the running job fails naming the cause, SIGTERM stops the server within 5 s, and no
process of its Ray outlives it. And SIGTERM sent to the server's whole process group at once
(``timeout``, a process supervisor killing the group), so its Ray dies as it stops, still
stops it within seconds: it does not wait out Ray's minute on a GCS that is gone."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest
import torch

from bnrecal.service.jobserver.ledger import Ledger, sqlite_url
from tests.api.server_process import ServerProcess, servers  # noqa: F401 - the fixture
from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net

pytestmark = pytest.mark.slow  # a server with its own Ray: ~30 s to start

GROUP_STOP_S = 10.0
"""A signal to the whole group stops the server within this (about 3 s here for SIGTERM: the
probe's 1.5 s to see Ray gone, then Ray's shutdown given 1.5 s; 1 s for Ctrl-C), far below
what waiting on Ray would take (its minute, or the drain's grace of ``GRACE_S``)."""

GRACE_S = "60"


def upload(client: httpx.Client, body: bytes) -> str:
    response = client.post("/v1/blobs", content=body, headers={"Content-Type": "application/octet-stream"})
    assert response.status_code == 201, response.text
    return response.json()["digest"]


def ray_processes(root: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(root).children(recursive=True)
            if p.name().startswith(("ray::", "gcs_server", "raylet")) or "ray/" in " ".join(p.cmdline()[:3])]


def assert_nothing_outlives(processes: list[psutil.Process]) -> None:
    """No process of the server's Ray is left running (zombies aside) a moment after it stopped."""
    gone = psutil.wait_procs([p for p in processes if p.is_running()], timeout=3)[1]
    assert [p.name() for p in gone if p.status() != psutil.STATUS_ZOMBIE] == []


def start_hanging_job(server: ServerProcess, tmp_path, **extra) -> tuple[dict, dict]:
    """A job whose third step hangs, submitted and seen running: its spec and its resource."""
    client = server.client
    samples = torch.randn(40, 4)
    samples[9, 0] = MARKER  # the third step hangs: the job stays running
    spec = {"arch": "tests.nets:marker_net", "model_kwargs": {"action": "hang"}, "batch_size": 4, "order": "given",
            "checkpoint": upload(client, save_state(tmp_path / "h.pt", marker_net()).read_bytes()),
            "data": upload(client, save_array(tmp_path / "h.npy", samples).read_bytes()), **extra}
    job = client.post("/v1/jobs", json=spec).json()
    deadline = time.monotonic() + 120
    while client.get(f"/v1/jobs/{job['id']}").json()["progress"]["samples_done"] == 0:
        assert time.monotonic() < deadline, "the job never got going"
        time.sleep(0.2)
    return spec, job


def test_a_killed_gcs_is_503_at_once_fails_the_running_job_and_sigterm_stops_everything(servers, tmp_path):  # noqa: F811
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", env={"BNRECAL_WARM_POOL_IDLE_S": "0"})
    servers.append(server)
    client = server.client
    spec, job = start_hanging_job(server, tmp_path)
    processes = ray_processes(server.process.pid)
    gcs = next(p for p in processes if p.name() == "gcs_server")

    gcs.kill()
    killed = time.monotonic()
    while (ready := client.get("/readyz", timeout=5)).status_code == 200:
        time.sleep(0.05)
    assert time.monotonic() - killed < 2.0
    assert ready.status_code == 503 and "GCS process exited" in ready.json()["detail"]
    asked = time.monotonic()
    refused = client.post("/v1/jobs", json=spec, timeout=10)
    assert time.monotonic() - asked < 2.0
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert "Ray cluster is unreachable" in refused.json()["detail"]
    while (ran := client.get(f"/v1/jobs/{job['id']}").json())["status"] == "running":
        assert time.monotonic() - killed < 10, "the running job was not failed"
        time.sleep(0.1)
    assert ran["status"] == "failed" and "GCS process exited" in ran["error"]["detail"]

    server.process.send_signal(signal.SIGTERM)
    stopping = time.monotonic()
    server.process.wait(5)  # TimeoutExpired: it did not stop within 5 s
    assert time.monotonic() - stopping < 5.0
    assert_nothing_outlives(processes)
    log = (tmp_path / "server.log").read_text()
    assert "embedded Ray instance's GCS process exited" in log


def test_sigterm_to_the_whole_process_group_stops_the_server_within_seconds(servers, tmp_path):  # noqa: F811
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    servers.append(server)
    processes = ray_processes(server.process.pid)
    assert any(p.name() == "gcs_server" for p in processes)

    os.killpg(server.process.pid, signal.SIGTERM)  # the server and its embedded Ray, at the same moment
    stopping = time.monotonic()
    server.process.wait(30)  # TimeoutExpired: it waited on the dead GCS (Ray's own limit is 60 s)
    assert time.monotonic() - stopping < GROUP_STOP_S
    assert_nothing_outlives(processes)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["group-SIGTERM", "group-Ctrl-C"])
def test_a_signal_to_the_whole_process_group_with_a_job_running_stops_the_server_within_seconds(
    servers, tmp_path, signum,  # noqa: F811
):
    """Ctrl-C in the terminal of ``bnrecal serve`` (SIGINT to its group), or ``timeout`` (SIGTERM
    to its group), while a job runs: its Ray dies as the server begins to stop, so neither the
    drain's grace nor the job's interruption may wait on it. The job goes back to the queue."""
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", env={"BNRECAL_SHUTDOWN_GRACE_S": GRACE_S})
    servers.append(server)
    _, job = start_hanging_job(server, tmp_path, workers=1)
    processes = ray_processes(server.process.pid)

    os.killpg(server.process.pid, signum)  # the server and its embedded Ray, at the same moment
    stopping = time.monotonic()
    server.process.wait(30)  # TimeoutExpired: it waited out the drain or the job on a dead Ray
    assert time.monotonic() - stopping < GROUP_STOP_S
    assert_nothing_outlives(processes)
    ledger = Ledger(sqlite_url(tmp_path / "data"))
    try:
        left = ledger.get_any(job["id"])
        assert left.status.value == "queued", left.status  # back in the queue, as a shutdown leaves a job
    finally:
        ledger.close()
