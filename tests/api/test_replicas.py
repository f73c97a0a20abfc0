"""Two ``bnrecal serve`` replicas on one Ray cluster, sharing a real Postgres ledger and a
moto S3 blob store: any replica answers any request, each job runs exactly once, and a
job whose replica is SIGKILLed is taken over by the other within its lease."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from sqlalchemy import create_engine, select

from bnrecal.service.jobserver.ledger import JobRow
from tests.api.conftest import free_port, submit, upload, wait_for, write_samples
from tests.api.server_process import REPO, ServerProcess, servers  # noqa: F401 - servers is a fixture
from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net, mixed_net

# Long enough that a replica starved on a loaded 2-core machine still renews in time (at 3 s
# one CI run saw a replica held up past its leases, and its two jobs taken over and run twice);
# short enough that the take-over below comes within seconds.
LEASE_S = 8.0


@pytest.fixture
def ray_head(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A Ray head on loopback with a token of its own, as the replicas' shared cluster; its
    environment (address and token) is what a replica needs to join it."""
    port = free_port()
    env = {
        "RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # loopback stays loopback (else Ray swaps in the routable address)
    }
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}",
               "--node-ip-address=127.0.0.1", "--num-cpus=8", "--include-dashboard=false",
               "--disable-usage-stats", "--block"]
    log = (tmp_path / "ray.log").open("ab")
    process = subprocess.Popen(
        command, env=os.environ | env | {"PYTHONPATH": str(REPO)},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "ray.log").read_text()[-3000:]
            time.sleep(0.25)
        yield env
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the head and every Ray process it started
        process.wait(30)
        log.close()


def runs(database_url: str) -> dict[str, tuple[int, str | None, str]]:
    """Each job's attempts, the replica that last held its lease (``host:pid:...``) and status."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(select(JobRow.id, JobRow.attempts, JobRow.lease_owner, JobRow.status))
            return {job_id: (attempts, owner, status) for job_id, attempts, owner, status in rows}
    finally:
        engine.dispose()


def lease_lines(*logs: Path) -> str:
    """What the replicas logged about their leases (late renewals, take-overs)."""
    return "\n".join(
        f"{log.name}: {line}" for log in logs for line in log.read_text(errors="replace").splitlines() if "lease" in line
    )


def owner_pid(owner: str | None) -> int:
    assert owner is not None
    return int(owner.split(":")[1])


def follow(server: ServerProcess, job_id: str) -> list[dict]:
    """Every event of a job's stream on ``server``, until it ends."""
    events = []
    with server.client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=180) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    return events


@pytest.mark.slow  # two server starts, a Ray head and ~24 jobs: ~2 min on a busy 2-core machine
def test_two_replicas_share_jobs_blobs_and_take_over_a_dead_replicas_job(
    ray_head, postgres, s3_server, servers, tmp_path
):
    # ``servers`` last: fixtures are torn down in reverse, so the replicas stop while their
    # Ray head still runs (the other way round, a replica's shutdown waits on a dead head).
    database_url = postgres.create_database()
    env = ray_head | {
        "BNRECAL_DATABASE_URL": database_url,
        "BNRECAL_BLOB_STORE": f"s3://{s3_server.bucket('replicas')}/{uuid.uuid4().hex[:8]}",
        "BNRECAL_S3_ENDPOINT_URL": s3_server.endpoint,
        "BNRECAL_JOB_LEASE_S": str(LEASE_S),
        "BNRECAL_LEDGER_POLL_S": "0.2",
        "BNRECAL_MAX_CONCURRENT_JOBS": "2",
        "BNRECAL_CPUS_PER_WORKER": "1",
    }
    a = ServerProcess(tmp_path / "a", tmp_path / "a.log", env)
    servers.append(a)
    b = ServerProcess(tmp_path / "b", tmp_path / "b.log", env)
    servers.append(b)

    # Upload to A, submit to B, follow the events on A, download from B.
    spec = {
        "arch": "tests.nets:mixed_net",
        "checkpoint": upload(a.client, save_state(tmp_path / "m.pt", mixed_net())),
        "data": upload(a.client, write_samples(tmp_path / "x.npy", 8)[0]),
    }
    first = submit(b.client, spec)
    events = follow(a, first["id"])
    assert events[-1]["status"] == "succeeded", events[-1]
    assert "running" in [event["status"] for event in events]  # seen on A while it ran (on A or B)
    artifact = b.client.get(f"/v1/jobs/{first['id']}/artifacts/checkpoint")
    assert artifact.status_code == 200
    assert artifact.headers["etag"] == f'"sha256:{hashlib.sha256(artifact.content).hexdigest()}"'
    ranged = a.client.get(f"/v1/jobs/{first['id']}/artifacts/checkpoint", headers={"Range": "bytes=0-9"})
    assert ranged.status_code == 206 and ranged.content == artifact.content[:10]

    # Concurrent submissions, spread over both replicas: each job runs exactly once.
    with ThreadPoolExecutor(8) as pool:
        jobs = list(pool.map(lambda i: submit((a, b)[i % 2].client, spec)["id"], range(20)))
    for job_id in jobs:
        assert wait_for((b, a)[jobs.index(job_id) % 2].client, job_id, timeout=300)["status"] == "succeeded"
    ran = runs(database_url)
    # one attempt each: no job ran twice (else the replicas' own words on their leases)
    assert [ran[job_id][0] for job_id in jobs] == [1] * 20, lease_lines(tmp_path / 'a.log', tmp_path / 'b.log')
    assert {owner_pid(ran[job_id][1]) for job_id in jobs} == {a.process.pid, b.process.pid}

    # SIGKILL the replica running a job: the other takes it over within the lease and runs it again.
    samples = torch.randn(40, 4)
    samples[5, 0] = MARKER
    slow = {
        "arch": "tests.nets:marker_net",
        "model_kwargs": {"action": "hang", "hang_s": 5.0},
        "checkpoint": upload(b.client, save_state(tmp_path / "k.pt", marker_net())),
        "data": upload(b.client, save_array(tmp_path / "k.npy", samples)),
        "batch_size": 4, "order": "given",
    }
    # A cancel sent to the replica that is not running the job stops it (read at a lease renewal).
    stuck = submit(a.client, slow | {"model_kwargs": {"action": "hang", "hang_s": 600.0}})["id"]
    wait_for(a.client, stuck, ("running",), progressed=True)
    runner = owner_pid(runs(database_url)[stuck][1])
    other = b if runner == a.process.pid else a
    assert other.client.post(f"/v1/jobs/{stuck}/cancel").status_code == 202
    asked = time.monotonic()
    assert wait_for(other.client, stuck, ("cancelled",), timeout=60)["status"] == "cancelled"
    assert time.monotonic() - asked < LEASE_S + 10

    victim_job = submit(a.client, slow)["id"]
    wait_for(a.client, victim_job, ("running",), progressed=True)
    holder = owner_pid(runs(database_url)[victim_job][1])
    victim, survivor = (a, b) if holder == a.process.pid else (b, a)
    victim.crash()
    killed = time.monotonic()
    while (rerun := survivor.client.get(f"/v1/jobs/{victim_job}").json())["attempts"] < 2:
        assert rerun["status"] in ("running", "queued") and time.monotonic() - killed < 60, rerun
        time.sleep(0.1)
    assert time.monotonic() - killed < LEASE_S + 5, rerun  # taken over once the lease ran out, not later
    done = wait_for(survivor.client, victim_job, timeout=180)
    assert done["status"] == "succeeded", done["error"]
    attempts, owner, _ = runs(database_url)[victim_job]
    assert attempts == 2 and owner_pid(owner) == survivor.process.pid
    survivor_log = tmp_path / ("a.log" if survivor is a else "b.log")
    assert f"job {victim_job}: its replica let its lease run out; now queued" in survivor_log.read_text(errors="replace")

    # Everything stored earlier is still served, by the survivor, with its old digest.
    again = survivor.client.get(f"/v1/jobs/{first['id']}/artifacts/checkpoint")
    assert again.content == artifact.content and again.headers["etag"] == artifact.headers["etag"]
    assert survivor.client.get(f"/v1/blobs/{spec['data']}").content == (tmp_path / "x.npy").read_bytes()
    assert survivor.client.delete(f"/v1/jobs/{first['id']}").status_code == 204
    assert survivor.client.get(f"/v1/jobs/{first['id']}/artifacts/checkpoint").status_code == 404
