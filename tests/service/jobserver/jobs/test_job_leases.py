"""Job leases between replicas sharing a ledger (SQLite and Postgres): one claim per job,
renewals that carry a cancel from another replica, take-over after a replica dies, outcomes
written only under the lease; the collector's one turn at a time; other replicas' changes
reaching this replica's change feed."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bnrecal.service.jobserver.jobs.events import ChangeFeed
from bnrecal.service.jobserver.jobs.leases import JobLeases, replica_id
from bnrecal.service.jobserver.records.views import Artifact, JobStatus
from bnrecal.service.jobserver.ledger import INTERRUPTED, Ledger
from bnrecal.service.jobserver.ledger.engines import exclusive_turn
from bnrecal.service.jobserver.problems import Problem
from bnrecal.service.jobserver.jobs.ledger_watch import LedgerWatcher

SPEC = {"arch": "tests.nets:mixed_net", "checkpoint": "sha256:" + "1" * 64, "data": "sha256:" + "2" * 64}
FAILED = Problem(type="about:blank", title="Failed", status=500, detail="the job failed")


@pytest.fixture
def replicas(database_url):
    """Two replicas: each its own connection pool on one database, and its own lease owner."""
    ledgers = [Ledger(database_url), Ledger(database_url)]
    yield [JobLeases(ledger, replica_id(), lease_s=30.0) for ledger in ledgers]
    for ledger in ledgers:
        ledger.close()


def test_replicas_racing_for_the_queue_claim_each_job_once(replicas):
    ids = [replicas[0].ledger.create(f"t{i % 3}", SPEC)[0].id for i in range(20)]

    def claim_all(leases: JobLeases) -> list[str]:
        return [job_id for job_id in ids if leases.claim(job_id) is not None]

    with ThreadPoolExecutor(4) as pool:
        claimed = list(pool.map(claim_all, [replicas[0], replicas[1], replicas[0], replicas[1]]))
    every = [job_id for part in claimed for job_id in part]
    assert sorted(every) == sorted(ids)  # each job exactly once
    for job_id in ids:
        job = replicas[0].ledger.get_any(job_id)
        assert job.status is JobStatus.running and job.attempts == 1


def test_a_renewal_keeps_the_lease_and_carries_a_cancel_sent_to_another_replica(replicas):
    a, b = replicas
    job, _ = a.ledger.create("alice", SPEC)
    started = a.claim(job.id)
    assert started is not None and started.phase == "starting workers"
    revision = a.ledger.get_any(job.id).revision
    assert a.renew(job.id).held and not a.renew(job.id).cancel_requested
    assert a.ledger.get_any(job.id).revision == revision  # a renewal is no event
    assert not b.renew(job.id).held  # not b's job
    b.ledger.request_cancel("alice", job.id)  # the cancel arrives at replica b
    renewal = a.renew(job.id)
    assert renewal.held and renewal.cancel_requested
    assert not b.finish(job.id, JobStatus.cancelled)  # only the lease holder writes the outcome
    assert a.finish(job.id, JobStatus.cancelled)
    assert not a.renew(job.id).held and a.ledger.get_any(job.id).status is JobStatus.cancelled


def test_a_dead_replicas_job_is_taken_over_once_its_lease_runs_out(replicas, tmp_path):
    a, b = replicas
    a.lease_s = 3.0  # long enough to be live at the first look on a loaded machine (0.5 s was not, once)
    job, _ = a.ledger.create("alice", SPEC)
    live, _ = a.ledger.create("alice", SPEC)
    assert a.claim(job.id) is not None
    claimed = time.monotonic()
    assert b.claim(live.id) is not None
    assert b.take_over_expired(rerun=True) == {}  # both leases are live
    time.sleep(max(0.0, claimed + a.lease_s + 0.3 - time.monotonic()))  # replica a died: nothing renews its lease
    assert b.take_over_expired(rerun=True) == {job.id: JobStatus.queued}
    requeued = b.ledger.get_any(job.id)
    assert requeued.status is JobStatus.queued and requeued.attempts == 1
    assert b.ledger.get_any(live.id).status is JobStatus.running  # b's own job stays b's
    rerun = b.claim(job.id)
    assert rerun is not None and rerun.attempts == 2
    assert b.take_over_expired(rerun=True) == {}  # claimed again: a live lease
    assert not a.renew(job.id).held  # replica a, if it only paused, learns it lost the job ...
    stale = Artifact(digest="stale", size=1, filename="report.json", media_type="application/json")
    assert not a.finish(job.id, JobStatus.succeeded, artifacts={"report": stale})  # ... and writes nothing
    assert not a.finish_making_room(job.id, JobStatus.failed, tmp_path / "work", error=FAILED)  # told, not raised
    written = stale.model_copy(update={"digest": "d"})
    assert b.finish(job.id, JobStatus.succeeded, artifacts={"report": written}, report={"ok": True})
    done = b.ledger.get_any(job.id)
    assert done.status is JobStatus.succeeded and done.artifacts == {"report": written}


def test_a_job_whose_replicas_keep_dying_fails_after_its_second_attempt(replicas):
    a, b = replicas
    a.lease_s = b.lease_s = 0.3
    job, _ = a.ledger.create("alice", SPEC)
    a.claim(job.id)
    time.sleep(0.5)
    assert b.take_over_expired(rerun=True) == {job.id: JobStatus.queued}
    b.claim(job.id)
    time.sleep(0.5)
    assert a.take_over_expired(rerun=True) == {job.id: JobStatus.failed}
    failed = a.ledger.get_any(job.id)
    assert failed.status is JobStatus.failed and INTERRUPTED in failed.error.detail


def test_the_collector_takes_its_turn_on_one_replica_at_a_time(replicas, database_url):
    engines = [leases.ledger.engine for leases in replicas]
    with exclusive_turn(engines[0], "storage collector") as first:
        with exclusive_turn(engines[1], "storage collector") as second:
            assert first
            assert second is database_url.startswith("sqlite")  # one process per SQLite ledger
        with exclusive_turn(engines[1], "another chore") as other:
            assert other
    with exclusive_turn(engines[1], "storage collector") as after:
        assert after  # let go at the end of the turn


def test_another_replicas_changes_reach_this_replicas_feed(replicas):
    a, b = replicas
    feed = ChangeFeed()
    published: list[str] = []
    feed.publish = published.append  # type: ignore[method-assign]  # record what the watcher publishes
    watcher = LedgerWatcher(a.ledger, feed, interval_s=0.1)
    job, _ = b.ledger.create("alice", SPEC)
    assert watcher.poll() == [job.id]
    assert watcher.poll() == []  # nothing moved
    b.claim(job.id)
    b.ledger.set_progress(job.id, 3, 10, "calibrating")
    assert watcher.poll() == [job.id]
    b.finish(job.id, JobStatus.succeeded)
    assert watcher.poll() == [job.id]  # the end of a job is seen too
    assert published == [job.id] * 3
