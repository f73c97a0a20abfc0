"""The job ledger, on SQLite and on PostgreSQL: tenancy, idempotency, the FIFO queue, state changes, crash recovery."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bnrecal.service.jobserver.records.views import Artifact, JobStatus
from bnrecal.service.jobserver.ledger import INTERRUPTED, Ledger, sqlite_url
from bnrecal.service.jobserver.ledger.engines import normalise_url
from bnrecal.errors import ConflictError, NotFoundError, SpecError, TooManyJobsError
from bnrecal.service.jobserver.problems import http_status

SPEC = {"arch": "tests.nets:mixed_net", "checkpoint": "sha256:" + "1" * 64, "data": "sha256:" + "2" * 64}


@pytest.fixture
def ledger(database_url):
    opened = Ledger(database_url)
    yield opened
    opened.close()


def test_a_job_belongs_to_its_tenant(ledger):
    job, created = ledger.create("alice", SPEC)
    assert created and job.status is JobStatus.queued and job.attempts == 0
    assert ledger.get("alice", job.id).spec == SPEC
    assert ledger.get("alice", job.id).created_at.tzinfo is not None
    with pytest.raises(NotFoundError):
        ledger.get("bob", job.id)
    assert [j.id for j in ledger.list("alice")] == [job.id]
    assert ledger.list("bob") == []


def test_idempotency_key_returns_the_same_job_per_tenant(ledger):
    first, created = ledger.create("alice", SPEC, "key-1")
    again, created_again = ledger.create("alice", SPEC, "key-1")
    assert created and not created_again and again.id == first.id
    other, other_created = ledger.create("bob", SPEC, "key-1")
    assert other_created and other.id != first.id
    with pytest.raises(ConflictError, match="key-1"):
        ledger.create("alice", SPEC | {"workers": 2}, "key-1")


def test_concurrent_retries_with_one_key_make_one_job(ledger):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: ledger.create("alice", SPEC, "same")[0].id, range(16)))
    assert len(set(results)) == 1
    assert len(ledger.list("alice")) == 1


def test_queue_heads_are_each_tenants_oldest_queued_job(ledger):
    ids = [ledger.create(tenant, SPEC)[0].id for tenant in ("bob", "bob", "alice", "bob", "carol")]
    assert [job.id for job in ledger.queue_heads()] == [ids[0], ids[2], ids[4]]
    ledger.mark_running(ids[0])
    ledger.request_cancel("carol", ids[4])
    assert [job.id for job in ledger.queue_heads()] == [ids[1], ids[2]]
    assert ledger.count_by_tenant(JobStatus.running) == {"bob": 1}
    assert ledger.count_by_tenant(JobStatus.queued) == {"bob": 2, "alice": 1}


def test_a_tenant_past_its_queued_limit_is_refused_and_nothing_is_stored(ledger):
    first = [ledger.create("alice", SPEC, max_queued=2)[0].id for _ in range(2)]
    with pytest.raises(TooManyJobsError, match="already has 2 queued jobs.*BNRECAL_TENANT_MAX_QUEUED_JOBS") as caught:
        ledger.create("alice", SPEC, max_queued=2)
    assert http_status(caught.value) == 429
    assert [job.id for job in ledger.queued()] == first  # the refused job was rolled back
    assert ledger.create("bob", SPEC, max_queued=2)[1]  # another tenant's queue is its own
    assert ledger.create("alice", SPEC, "replayed", max_queued=3)[1]
    assert not ledger.create("alice", SPEC, "replayed", max_queued=3)[1]  # a replay is no new job
    ledger.mark_running(first[0])  # a started job leaves the queue: room again
    assert ledger.create("alice", SPEC, max_queued=3)[1]


def test_concurrent_submissions_never_pass_the_queued_limit(ledger):
    def submit(_):
        try:
            return ledger.create("alice", SPEC, max_queued=5)[0].id
        except TooManyJobsError:
            return None

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(submit, range(24)))
    assert sum(1 for job_id in results if job_id) == 5
    assert len(ledger.queued()) == 5


def test_queue_is_fifo_and_a_job_starts_once(ledger):
    ids = [ledger.create(tenant, SPEC)[0].id for tenant in ("alice", "bob", "alice")]
    assert [job.id for job in ledger.queued()] == ids
    started = ledger.mark_running(ids[0])
    assert started is not None and started.status is JobStatus.running and started.attempts == 1
    assert started.started_at is not None
    assert ledger.mark_running(ids[0]) is None
    assert [job.id for job in ledger.queued()] == ids[1:]


def test_every_change_bumps_the_revision_and_terminal_is_final(ledger):
    job, _ = ledger.create("alice", SPEC)
    revisions = [job.revision]
    ledger.mark_running(job.id)
    revisions.append(ledger.get_any(job.id).revision)
    assert ledger.get_any(job.id).phase == "starting workers"
    assert ledger.set_progress(job.id, 5, 10, "calibrating")
    revisions.append(ledger.get_any(job.id).revision)
    assert ledger.set_phase(job.id, "writing")
    revisions.append(ledger.get_any(job.id).revision)
    moved = ledger.get_any(job.id)
    assert (moved.phase, moved.samples_done, moved.samples_total) == ("writing", 5, 10)
    report = Artifact(digest="d", size=2, filename="report.json", media_type="application/json")
    assert ledger.finish(job.id, JobStatus.succeeded, artifacts={"report": report}, report={"samples": 10})
    done = ledger.get_any(job.id)
    assert done.artifacts == {"report": report}  # read back typed, as written
    revisions.append(done.revision)
    assert revisions == sorted(set(revisions)) and len(revisions) == 5
    assert done.status is JobStatus.succeeded and done.finished_at is not None and done.report == {"samples": 10}
    assert not ledger.finish(job.id, JobStatus.failed)
    assert not ledger.set_progress(job.id, 1, 10, "calibrating") and not ledger.set_phase(job.id, "exporting")
    assert ledger.get_any(job.id).status is JobStatus.succeeded


def test_cancel_queued_at_once_running_by_flag_finished_conflicts(ledger):
    queued, _ = ledger.create("alice", SPEC)
    assert ledger.request_cancel("alice", queued.id).status is JobStatus.cancelled
    assert ledger.mark_running(queued.id) is None
    running, _ = ledger.create("alice", SPEC)
    ledger.mark_running(running.id)
    flagged = ledger.request_cancel("alice", running.id)
    assert flagged.status is JobStatus.running and flagged.cancel_requested
    with pytest.raises(NotFoundError):
        ledger.request_cancel("bob", running.id)
    ledger.finish(running.id, JobStatus.failed)
    with pytest.raises(ConflictError, match="already failed"):
        ledger.request_cancel("alice", running.id)


def test_recovery_reruns_once_then_fails_and_survives_reopening(database_url):
    ledger = Ledger(database_url)
    first, _ = ledger.create("alice", SPEC)
    cancelled, _ = ledger.create("alice", SPEC)
    finished, _ = ledger.create("alice", SPEC)
    for job in (first, cancelled, finished):
        ledger.mark_running(job.id)
    ledger.request_cancel("alice", cancelled.id)
    ledger.finish(finished.id, JobStatus.succeeded, report={"ok": True})
    ledger.close()

    reopened = Ledger(database_url)  # as after a crash: no runner ever finished them
    outcomes = reopened.recover_interrupted(rerun=True)
    assert outcomes == {first.id: JobStatus.queued, cancelled.id: JobStatus.cancelled}
    assert reopened.get_any(finished.id).report == {"ok": True}
    # first run again and interrupted again: no third attempt
    assert reopened.mark_running(first.id).attempts == 2
    outcomes = reopened.recover_interrupted(rerun=True)
    failed = reopened.get_any(first.id)
    assert outcomes == {first.id: JobStatus.failed} and failed.status is JobStatus.failed
    assert INTERRUPTED in failed.error.detail and failed.finished_at is not None
    assert not [job for job in reopened.list("alice") if job.status is JobStatus.running]
    reopened.close()


def test_recovery_without_rerun_fails_interrupted_jobs(ledger):
    job, _ = ledger.create("alice", SPEC)
    ledger.mark_running(job.id)
    assert ledger.recover_interrupted(rerun=False) == {job.id: JobStatus.failed}
    assert ledger.get_any(job.id).error.detail == INTERRUPTED


def test_requeue_on_shutdown_does_not_count_the_attempt(ledger):
    job, _ = ledger.create("alice", SPEC)
    ledger.mark_running(job.id)
    assert ledger.requeue(job.id)
    requeued = ledger.get_any(job.id)
    assert requeued.status is JobStatus.queued and requeued.attempts == 0 and requeued.started_at is None


def test_counts_by_status(ledger):
    a, _ = ledger.create("alice", SPEC)
    ledger.create("bob", SPEC)
    ledger.mark_running(a.id)
    counts = ledger.count_by_status()
    assert counts[JobStatus.running] == 1 and counts[JobStatus.queued] == 1 and counts[JobStatus.failed] == 0


def _drop_column(url, postgres_fixture, column):
    """Make the jobs table as an earlier release did: without ``column``."""
    if url.startswith("sqlite"):
        import sqlite3

        with sqlite3.connect(url.split("///", 1)[1]) as connection:
            connection.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
    else:
        postgres_fixture.execute(url, f"ALTER TABLE jobs DROP COLUMN {column}")


def test_a_ledger_from_before_the_phase_and_lease_columns_is_upgraded_in_place(database_url, request):
    old = Ledger(database_url)
    job, _ = old.create("alice", SPEC)
    old.close()
    postgres = request.getfixturevalue("postgres") if database_url.startswith("postgres") else None
    for column in ("phase", "lease_owner", "lease_expires_at"):  # as releases before them made the table
        _drop_column(database_url, postgres, column)
    upgraded = Ledger(database_url)
    try:
        kept = upgraded.get("alice", job.id)
        assert kept.spec == SPEC and kept.phase is None
        upgraded.mark_running(job.id)
        assert upgraded.get_any(job.id).phase == "starting workers"
        assert upgraded.recover_interrupted(rerun=True, expired_before=kept.created_at) == {job.id: JobStatus.queued}
    finally:
        upgraded.close()


def test_replicas_opening_one_new_database_together_create_the_schema_once(database_url):
    with ThreadPoolExecutor(6) as pool:
        opened = list(pool.map(lambda _: Ledger(database_url), range(6)))
    try:
        job, _ = opened[0].create("alice", SPEC)
        assert all(ledger.get("alice", job.id).spec == SPEC for ledger in opened)
    finally:
        for ledger in opened:
            ledger.close()


def test_the_database_url_names_a_supported_database():
    assert normalise_url("postgresql://u:p@db/bnrecal") == "postgresql+psycopg://u:p@db/bnrecal"
    assert normalise_url("postgres://db/x") == "postgresql+psycopg://db/x"
    assert sqlite_url(Path("/d")) == normalise_url("sqlite:////d/ledger.db")
    with pytest.raises(SpecError, match="BNRECAL_DATABASE_URL.*'mysql'"):
        normalise_url("mysql://db/x")
    with pytest.raises(SpecError, match="BNRECAL_DATABASE_URL.*psycopg 3"):
        normalise_url("postgresql+psycopg2://db/x")


def test_an_outcome_is_stored_as_plain_json_and_read_back_typed(ledger):
    """The problem, artifacts and phases columns hold the JSON the API shows (what an older
    or newer release reads), and come back as the typed objects that were written."""
    from sqlalchemy import text

    from bnrecal.service.jobserver.problems import Problem

    job, _ = ledger.create("alice", SPEC)
    ledger.mark_running(job.id)
    ledger.set_phase(job.id, "exporting")
    onnx = Artifact(digest="sha256:" + "3" * 64, size=7, filename="model.onnx", media_type="application/octet-stream")
    problem = Problem(type="https://bnrecal.dev/problems/export", title="Export failed", status=422, detail="no", field="onnx")
    assert ledger.finish(job.id, JobStatus.failed, error=problem, artifacts={"onnx": onnx})
    with ledger.engine.connect() as connection:
        raw = connection.execute(text("SELECT error, artifacts, phases FROM jobs WHERE id = :id"), {"id": job.id}).one()
    import json

    error, artifacts, phases = (json.loads(value) if isinstance(value, str) else value for value in raw)
    assert error == problem.body() and artifacts == {"onnx": onnx.model_dump(mode="json")}
    assert [entry["phase"] for entry in phases] == ["starting workers", "exporting"] and all("at" in e for e in phases)
    done = ledger.get_any(job.id)
    assert done.error == problem and done.error.body() == problem.body() and done.artifacts == {"onnx": onnx}
    assert [entry.phase for entry in done.phases] == ["starting workers", "exporting"]
    assert [time.phase for time in done.phase_times()] == ["starting workers", "exporting"]
