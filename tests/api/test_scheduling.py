"""The queue: cancel mid-run frees the actors; 20 concurrent submissions all finish, in order,
never more at once than the cluster's CPUs hold; a job the cluster can never place is 422 at
submission; tenants take turns (one's backlog delays another's job by at most one job) within
their running and queued limits."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest
import ray
import torch
from ray.util.placement_group import placement_group_table

from bnrecal.service.client import parse_events
from bnrecal.service.jobserver.records.spec import JobSpec

from tests.api.conftest import submit, upload, wait_for, write_samples
from tests.api.test_storage import KEY, OTHER_KEY, client_of, serve
from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net, mixed_net

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.fresh_ranks]  # the cluster's free CPUs are checked here


def free_cpus_settle(expected: float, pool, timeout: float = 30) -> float:
    """The cluster's free CPUs once they reach ``expected`` (or the timeout passed). Idle warm
    gangs are let go on every look: an earlier job's ranks may come back to the pool late."""
    deadline = time.monotonic() + timeout
    while True:
        pool.evict_for({"CPU": expected})
        free = ray.available_resources().get("CPU", 0.0)
        if free >= expected or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def test_cancel_mid_run_stops_the_job_and_frees_its_actors(live_server, tmp_path):
    total = ray.cluster_resources()["CPU"]
    samples = torch.randn(40, 4)
    samples[9, 0] = MARKER  # the third step hangs: the job is mid-run with progress made
    with live_server.client("load") as client:
        spec = {
            "arch": "tests.nets:marker_net",
            "model_kwargs": {"action": "hang"},
            "checkpoint": upload(client, save_state(tmp_path / "m.pt", marker_net())),
            "data": upload(client, save_array(tmp_path / "m.npy", samples)),
            "workers": 2,
            "batch_size": 4, "order": "given",
        }
        job = submit(client, spec)
        running = wait_for(client, job["id"], ("running",), progressed=True)
        pool = live_server.services.pool
        idle_before = set(pool.idle())
        assert 0 < running["progress"]["samples_done"] < 40
        assert ray.available_resources().get("CPU", 0.0) < total  # its actors hold CPUs
        assert client.get(f"/v1/jobs/{job['id']}/artifacts/report").status_code == 409
        with client.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
            cancel = client.post(f"/v1/jobs/{job['id']}/cancel")
            assert cancel.status_code == 202
            events = list(parse_events(stream.iter_lines()))
        assert events[-1].data["status"] == "cancelled"
        final = client.get(f"/v1/jobs/{job['id']}").json()
        assert final["status"] == "cancelled" and final["finished_at"] is not None
        assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202  # cancelling again: a no-op
    assert set(pool.idle()) <= idle_before  # the cancelled job's ranks did not go back to the warm pool
    # The cancelled job's actors killed, its placement group removed (idle warm gangs of
    # earlier jobs hold CPUs too: they are let go).
    free = free_cpus_settle(total, pool)
    held = [(g.get("name"), g.get("bundles")) for g in placement_group_table().values() if g.get("state") == "CREATED"]
    assert free == total, f"{total - free} CPUs still held; placement groups alive: {held}; idle gangs: {pool.idle()}"


@pytest.mark.slow  # 20 jobs, each starting its actor: ~2 min on a busy 2-core machine
def test_twenty_concurrent_submissions_all_finish_fifo_within_the_bound(live_server, tmp_path):
    runner = live_server.services.runner
    counts = [4, 5, 6, 4]
    with live_server.client("load") as client:
        checkpoint = upload(client, save_state(tmp_path / "m.pt", mixed_net()))
        datasets = [upload(client, write_samples(tmp_path / f"x{i}.npy", n, seed=i)[0]) for i, n in enumerate(counts)]
        specs = [
            {"arch": "tests.nets:mixed_net", "checkpoint": checkpoint, "data": datasets[i % 4], "batch_size": 2}
            for i in range(20)
        ]
        with ThreadPoolExecutor(20) as pool:
            jobs = list(pool.map(lambda spec: submit(client, spec), specs))
        finished = [wait_for(client, job["id"], timeout=240) for job in jobs]
        queue_order = [job["id"] for job in reversed(client.get("/v1/jobs", params={"limit": 20}).json()["jobs"])]
    assert [job["status"] for job in finished] == ["succeeded"] * 20, [j["error"] for j in finished]
    for i, job in enumerate(finished):
        assert job["report"]["samples"] == counts[i % 4]
        assert job["progress"]["samples_done"] == job["progress"]["samples_total"] == counts[i % 4]

    cpus, _ = runner.job_resources(JobSpec.model_validate(specs[0]))
    bound = max(1, int(ray.cluster_resources()["CPU"] // cpus))
    spans = [(_time(j["started_at"]), _time(j["finished_at"])) for j in finished]
    most_at_once = max(sum(1 for s, f in spans if s <= start < f) for start, _ in spans)
    assert 1 <= most_at_once <= bound
    assert sorted(queue_order) == sorted(job["id"] for job in jobs)
    started = {job["id"]: _time(job["started_at"]) for job in finished}
    starts = [started[job_id] for job_id in queue_order]
    assert starts == sorted(starts), "jobs must start in queue order"


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def test_a_second_job_of_the_same_shape_runs_on_warm_ranks(live_server, tmp_path):
    pool = live_server.services.pool
    with live_server.client("load") as client:
        spec = {
            "arch": "tests.nets:mixed_net",
            "checkpoint": upload(client, save_state(tmp_path / "w.pt", mixed_net())),
            "data": upload(client, write_samples(tmp_path / "w.npy", 9, seed=3)[0]),
            "workers": 2, "placement": "strict_pack",  # a shape no other test of the session uses
            "batch_size": 3,
        }
        first = wait_for(client, submit(client, spec)["id"])
        [gang] = [g for g in pool.idle() if (g.key.world_size, g.key.placement_strategy) == (2, "STRICT_PACK")]
        second = wait_for(client, submit(client, spec)["id"])
    assert first["status"] == second["status"] == "succeeded"
    assert first["report"]["samples"] == second["report"]["samples"] == 9
    [again] = [g for g in pool.idle() if g.ident == gang.ident]
    assert again.key == gang.key and again.jobs == 2  # the same actors served both


def problem(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    return response.json()


def test_a_job_the_cluster_can_never_place_is_422_at_submission_naming_the_field(live_server, tmp_path):
    cpus = ray.cluster_resources()["CPU"]
    with live_server.client("load") as client:
        spec = {
            "arch": "tests.nets:mixed_net",
            "checkpoint": upload(client, save_state(tmp_path / "c.pt", mixed_net())),
            "data": upload(client, write_samples(tmp_path / "c.npy", 4)[0]),
        }
        too_many = problem(client.post("/v1/jobs", json=spec | {"workers": 1024}), 422)
        strict = problem(client.post("/v1/jobs", json=spec | {"workers": 2, "placement": "strict_spread"}), 422)
        cuda = client.post("/v1/jobs", json=spec | {"device": "cuda"})
        queued = client.get("/v1/jobs", params={"status": "queued"}).json()["jobs"]
    assert too_many["field"] == "workers" and too_many["detail"].startswith("workers: 1024 ranks")
    assert f"the cluster has {cpus:g} CPUs" in too_many["detail"] and "BNRECAL_CAPACITY_CHECK" in too_many["detail"]
    assert strict["field"] == "placement" and "1 node(s) have room" in strict["detail"]
    if not ray.cluster_resources().get("GPU"):
        assert problem(cuda, 422)["field"] == "device" and "no GPU" in cuda.json()["detail"]
    assert queued == []  # nothing was queued to wait out a placement timeout


def hanging_spec(client, tmp_path, hang_s: float, marked: bool = True) -> dict:
    """A marker_net job whose second step sleeps ``hang_s`` seconds (none without ``marked``)."""
    samples = torch.randn(8, 4)
    if marked:
        samples[7, 0] = MARKER  # not sample 0: the driver's probe forward must not sleep
    name = f"h{hang_s}-{marked}"
    return {
        "arch": "tests.nets:marker_net",
        "model_kwargs": {"action": "hang", "hang_s": hang_s},
        "checkpoint": upload(client, save_state(tmp_path / f"{name}.pt", marker_net())),
        "data": upload(client, save_array(tmp_path / f"{name}.npy", samples)),
        "batch_size": 4, "order": "given",
    }


def test_one_tenants_backlog_delays_anothers_job_by_at_most_one_job(tmp_path):
    # One job at a time, so the order is plain: FIFO would run B's 10 jobs (~2 s each) before A's.
    with serve(tmp_path, max_concurrent_jobs=1) as live, client_of(live, KEY) as a, client_of(live, OTHER_KEY) as b:
        queued = hanging_spec(b, tmp_path, hang_s=2.0)  # uploaded once: the ten jobs are the same job
        backlog = [submit(b, queued) for _ in range(10)]
        wait_for(b, backlog[0]["id"], ("running",))
        mine = submit(a, hanging_spec(a, tmp_path, hang_s=2.0, marked=False))
        done = wait_for(a, mine["id"], timeout=60)
        theirs = [b.get(f"/v1/jobs/{job['id']}").json() for job in backlog]
        for job in backlog:
            b.post(f"/v1/jobs/{job['id']}/cancel")
    assert done["status"] == "succeeded", done["error"]
    started = _time(done["started_at"])
    ahead = [job for job in theirs if job["started_at"] and _time(job["started_at"]) < started]
    assert [job["id"] for job in ahead] == [backlog[0]["id"]]  # only the job already running when A queued
    one_job = _time(theirs[0]["finished_at"]) - _time(theirs[0]["started_at"])
    waited = started - _time(done["created_at"])
    print(f"A waited {waited.total_seconds():.2f} s behind B's backlog; B's running job took {one_job.total_seconds():.2f} s")
    assert waited.total_seconds() <= one_job.total_seconds() + 1.0


def test_tenant_limits_skip_a_tenant_at_its_running_limit_and_429_past_its_queue(tmp_path):
    with (
        serve(tmp_path, tenant_max_running_jobs=1, tenant_max_queued_jobs=2) as live,
        client_of(live, KEY) as a, client_of(live, OTHER_KEY) as b,
    ):
        spec = hanging_spec(b, tmp_path, hang_s=600.0)
        backlog = [submit(b, spec)]
        wait_for(b, backlog[0]["id"], ("running",))
        backlog += [submit(b, spec) for _ in range(2)]
        refused = b.post("/v1/jobs", json=spec)
        mine = wait_for(a, submit(a, hanging_spec(a, tmp_path, hang_s=0.0, marked=False))["id"], timeout=90)
        statuses = [b.get(f"/v1/jobs/{job['id']}").json()["status"] for job in backlog]
        for job in backlog:
            assert b.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
    assert mine["status"] == "succeeded", mine["error"]  # the cluster had room: A went on
    assert statuses == ["running", "queued", "queued"]  # B at its limit of 1 running job
    failure = problem(refused, 429)
    assert refused.headers["retry-after"].isdigit()
    assert "already has 2 queued jobs" in failure["detail"] and "BNRECAL_TENANT_MAX_QUEUED_JOBS" in failure["detail"]
