"""The job ledger: every job's spec, status, progress and outputs, in SQL (SQLite by default,
PostgreSQL for a replicated service: ``service/jobserver/ledger/engines.py``).

The ledger, not Ray, is the source of truth: it survives restarts, and every state
change goes through a conditional update here, so a cancel racing a start, or two
retries of the same ``Idempotency-Key``, end in exactly one outcome. Each change bumps
the job's ``revision``, which numbers the job's Server-Sent Events.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy import delete as sql_delete
from sqlalchemy import update as sql_update
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from bnrecal.errors import ConflictError, InputError, InsufficientStorageError, NotFoundError, TooManyJobsError

from bnrecal.service.run.options import STARTING_PHASE

from bnrecal.service.jobserver.disk import FREE_SPACE_HINT, is_disk_full
from bnrecal.service.jobserver.records.record import JobRecord
from bnrecal.service.jobserver.records.views import Artifact, JobStatus, PhaseEntry
from bnrecal.service.jobserver.ledger.engines import lock_tenant, make_engine, prepare_schema
from bnrecal.service.jobserver.ledger.table import Base, JobRow
from bnrecal.service.jobserver.problems import Problem

INTERRUPTED = "interrupted by restart"
MAX_ATTEMPTS = 2  # a job a crash interrupted runs again from scratch once


def sqlite_url(data_dir: Path) -> str:
    """The default ledger: ``ledger.db`` in the data directory."""
    return f"sqlite:///{Path(data_dir).absolute() / 'ledger.db'}"


def _now() -> datetime:
    return datetime.now(UTC)


def outcome_values(
    error: Problem | None = None, artifacts: dict[str, Artifact] | None = None, report: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The columns a job's outcome writes as it ends: when, its problem (None clears an
    earlier one), and the artifacts and report where given."""
    values: dict[str, Any] = {"finished_at": _now(), "error": error}
    if artifacts is not None:
        values["artifacts"] = artifacts
    if report is not None:
        values["report"] = report
    return values


def _phase_key(phase: str) -> str:
    """What a phase counts as in a job's ``phases``: a sweep's cell as a whole (``[3/16 m2/cam1]``
    for each of its phases), so a sweep of a thousand cells keeps a thousand entries, not one
    per phase of each."""
    if phase.startswith("[") and "] " in phase:
        return phase.split("] ", 1)[0] + "]"
    return phase


def start_values() -> dict[str, Any]:
    """What starting a queued job writes: the attempt counted, progress reset, the first phase."""
    now = _now()
    return {
        "status": JobStatus.running.value, "started_at": now, "attempts": JobRow.attempts + 1,
        "samples_done": 0, "samples_total": None, "phase": STARTING_PHASE,
        "phases": [PhaseEntry(phase=STARTING_PHASE, at=now)],
        "artifacts": {}, "report": None,  # a sweep's cells of an earlier attempt are done again
    }


class Ledger:
    """The repository of jobs: the only code that reads or writes the jobs table."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        prepare_schema(self.engine, Base.metadata)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        """Release the database connections."""
        self.engine.dispose()

    @contextmanager
    def _session(self) -> Iterator[Session]:
        """One transaction: committed whole, or (on any error) rolled back whole. A full disk
        (SQLite's "database or disk is full", Postgres's DiskFull) is the 507 naming the
        ledger; the jobs stored before are untouched (docs/storage.md, "A full disk")."""
        try:
            with self._sessions.begin() as session:
                yield session
        except DBAPIError as exc:
            if is_disk_full(exc):
                raise InsufficientStorageError(
                    "the server's disk is full (job ledger): the change was not written, the jobs stored before are "
                    f"untouched; {FREE_SPACE_HINT}"
                ) from exc
            raise

    def create(
        self, tenant: str, spec: dict[str, Any], idempotency_key: str | None = None, max_queued: int | None = None
    ) -> tuple[JobRecord, bool]:
        """Queue a new job; with a known ``idempotency_key``, return that job instead.

        Returns the job and whether it was created now. Reusing a key with another spec
        is a ``ConflictError``; a new job that would give the tenant more than ``max_queued``
        queued jobs is a ``TooManyJobsError`` (counted after the insert, in its transaction:
        the tenant's transactions take turns, so the bound is exact).
        """
        if idempotency_key is not None:
            existing = self._by_idempotency_key(tenant, idempotency_key)
            if existing is not None:
                return self._same_spec(existing, spec), False
        row = JobRow(
            id=uuid.uuid4().hex, tenant=tenant, status=JobStatus.queued.value, spec=spec,
            idempotency_key=idempotency_key, attempts=0, cancel_requested=False, samples_done=0,
            artifacts={}, revision=1, created_at=_now(),
        )
        try:
            with self._session() as session:
                lock_tenant(session, tenant)
                session.add(row)
                session.flush()
                if max_queued is not None:
                    self._check_queued(session, tenant, max_queued)
        except IntegrityError:  # a concurrent retry with the same key won the race
            existing = self._by_idempotency_key(tenant, idempotency_key) if idempotency_key else None
            if existing is None:
                raise
            return self._same_spec(existing, spec), False
        return row.record(), True

    def get(self, tenant: str, job_id: str) -> JobRecord:
        """A tenant's job; ``NotFoundError`` for an unknown id or another tenant's job."""
        with self._session() as session:
            row = session.scalar(select(JobRow).where(JobRow.id == job_id, JobRow.tenant == tenant))
            if row is None:
                raise NotFoundError(f"no job {job_id!r} for this API key")
            return row.record()

    def get_any(self, job_id: str) -> JobRecord:
        """A job whoever owns it (for the runner)."""
        with self._session() as session:
            row = session.scalar(select(JobRow).where(JobRow.id == job_id))
            if row is None:
                raise NotFoundError(f"no job {job_id!r}")
            return row.record()

    def list(
        self, tenant: str, status: JobStatus | None = None, limit: int = 50, before: str | None = None
    ) -> list[JobRecord]:
        """A tenant's jobs, newest first; with ``before`` (a job id of the tenant's: the cursor
        a previous page ended with) only the jobs submitted before that one."""
        query = select(JobRow).where(JobRow.tenant == tenant)
        if status is not None:
            query = query.where(JobRow.status == status.value)
        with self._session() as session:
            if before is not None:
                seq = session.scalar(select(JobRow.seq).where(JobRow.id == before, JobRow.tenant == tenant))
                if seq is None:
                    raise InputError(
                        f"cursor {before!r} is no job of this API key (it was deleted, or is not a cursor "
                        "this server gave); list again from the newest"
                    )
                query = query.where(JobRow.seq < seq)
            return [row.record() for row in session.scalars(query.order_by(JobRow.seq.desc()).limit(limit))]

    def get_many(self, tenant: str, job_ids: Iterable[str]) -> list[JobRecord]:
        """Those of ``job_ids`` that are the tenant's jobs (others' and unknown ids are left out)."""
        wanted = list(job_ids)
        if not wanted:
            return []
        query = select(JobRow).where(JobRow.tenant == tenant, JobRow.id.in_(wanted)).order_by(JobRow.seq)
        with self._session() as session:
            return [row.record() for row in session.scalars(query)]

    def queued(self, limit: int = 100) -> list[JobRecord]:
        """Queued jobs of every tenant, oldest first."""
        query = select(JobRow).where(JobRow.status == JobStatus.queued.value).order_by(JobRow.seq).limit(limit)
        with self._session() as session:
            return [row.record() for row in session.scalars(query)]

    def queue_heads(self) -> list[JobRecord]:
        """The oldest queued job of each tenant, oldest first: whom the dispatcher chooses between."""
        heads = (
            select(func.min(JobRow.seq)).where(JobRow.status == JobStatus.queued.value).group_by(JobRow.tenant)
        )
        query = select(JobRow).where(JobRow.seq.in_(heads.scalar_subquery())).order_by(JobRow.seq)
        with self._session() as session:
            return [row.record() for row in session.scalars(query)]

    def count_by_tenant(self, status: JobStatus) -> dict[str, int]:
        """How many jobs each tenant has in ``status`` (tenants with none are left out)."""
        query = select(JobRow.tenant, func.count()).where(JobRow.status == status.value).group_by(JobRow.tenant)
        with self._session() as session:
            return {tenant: count for tenant, count in session.execute(query)}

    def count_by_status(self) -> dict[JobStatus, int]:
        """How many jobs are in each status."""
        counts = {status: 0 for status in JobStatus}
        with self._session() as session:
            for status, count in session.execute(select(JobRow.status, func.count()).group_by(JobRow.status)):
                counts[JobStatus(status)] = count
        return counts

    def every_job(self) -> list[JobRecord]:
        """Every job of every tenant, oldest first (for the storage collector)."""
        with self._session() as session:
            return [row.record() for row in session.scalars(select(JobRow).order_by(JobRow.seq))]

    def delete_finished(self, tenant: str | None, job_id: str) -> JobRecord:
        """Remove a job that has ended from the ledger (``tenant`` None: whoever owns it);
        ``NotFoundError`` if unknown, ``ConflictError`` while it is queued or running."""
        job = self.get(tenant, job_id) if tenant is not None else self.get_any(job_id)
        terminal = [status.value for status in JobStatus if status.is_terminal]
        statement = sql_delete(JobRow).where(JobRow.id == job_id, JobRow.status.in_(terminal))
        with self._session() as session:
            if session.execute(statement).rowcount == 1:
                return job
        raise ConflictError(
            f"job {job_id} is {self.get_any(job_id).status.value}; cancel it first, only finished jobs can be deleted"
        )

    def mark_running(self, job_id: str) -> JobRecord | None:
        """Start a queued job (counting the attempt); None if it is no longer queued."""
        changed = self._update(job_id, {JobStatus.queued}, **start_values())
        return self.get_any(job_id) if changed else None

    def set_progress(self, job_id: str, done: int, total: int, phase: str) -> bool:
        """Record a running job's phase and the samples done of the phase's total."""
        return self._update(
            job_id, {JobStatus.running}, samples_done=done, samples_total=total, phase=phase,
            **self._phase_entered(job_id, phase),
        )

    def set_phase(self, job_id: str, phase: str) -> bool:
        """Record that a running job entered a phase that does not count samples (exporting, writing)."""
        return self._update(job_id, {JobStatus.running}, phase=phase, **self._phase_entered(job_id, phase))

    def set_partial(self, job_id: str, artifacts: dict[str, Artifact], report: dict[str, Any]) -> bool:
        """Record what a running sweep has finished so far: its cells' artifacts, and its
        matrix report as it stands (docs/sweeps.md, "Over HTTP")."""
        return self._update(job_id, {JobStatus.running}, artifacts=artifacts, report=report)

    def _phase_entered(self, job_id: str, phase: str) -> dict[str, Any]:
        """The ``phases`` column with ``phase`` appended (and when it began) if the job was in
        another phase; nothing to change while it stays in the same one. A job's progress is
        written by one thread, so reading then writing cannot interleave with another writer."""
        with self._session() as session:
            row = session.execute(select(JobRow.phase, JobRow.phases).where(JobRow.id == job_id)).first()
        if row is None or row.phase is not None and _phase_key(row.phase) == _phase_key(phase):
            return {}
        return {"phases": [*(row.phases or []), PhaseEntry(phase=_phase_key(phase), at=_now())]}

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        *,
        error: Problem | None = None,
        artifacts: dict[str, Artifact] | None = None,
        report: dict[str, Any] | None = None,
    ) -> bool:
        """Move an unfinished job to a terminal status with its outcome."""
        assert status.is_terminal
        return self._update(job_id, {JobStatus.queued, JobStatus.running}, status=status.value,
                            **outcome_values(error, artifacts, report))

    def request_cancel(self, tenant: str, job_id: str) -> JobRecord:
        """Cancel a tenant's job: a queued one at once, a running one by flagging it for the runner."""
        job = self.get(tenant, job_id)
        if job.status is JobStatus.queued and self.finish(job_id, JobStatus.cancelled):
            return self.get_any(job_id)
        if self._update(job_id, {JobStatus.running}, cancel_requested=True):
            return self.get_any(job_id)
        job = self.get_any(job_id)
        if job.status is JobStatus.cancelled:
            return job
        raise ConflictError(f"job {job_id} already {job.status.value}; only queued or running jobs can be cancelled")

    def requeue(self, job_id: str, *conditions: Any) -> bool:
        """Put a running job back in the queue without counting its attempt (a clean shutdown),
        where it meets any further ``conditions`` (a replica's lease)."""
        return self._update(
            job_id, {JobStatus.running}, *conditions,
            status=JobStatus.queued.value, started_at=None, attempts=JobRow.attempts - 1, samples_done=0,
            phases=None, lease_owner=None, lease_expires_at=None,
        )

    def recover_interrupted(self, rerun: bool, expired_before: datetime | None = None) -> dict[str, JobStatus]:
        """After a crash: queue each job left ``running`` again once, or fail it; returns the outcomes.

        With ``expired_before`` (a ledger shared by replicas) only the jobs whose replica let
        their lease run out before then, checked again in each update, so a job another
        replica has just claimed or renewed is left alone.
        """
        outcomes: dict[str, JobStatus] = {}
        expired = [] if expired_before is None else [
            JobRow.lease_owner.is_(None) | (JobRow.lease_expires_at < expired_before)
        ]
        with self._session() as session:
            rows = session.scalars(select(JobRow).where(JobRow.status == JobStatus.running.value, *expired)).all()
            stuck = [(row.id, row.attempts, row.cancel_requested) for row in rows]
        for job_id, attempts, cancel_requested in stuck:
            running = {JobStatus.running}
            if cancel_requested:
                outcome = JobStatus.cancelled
                values: dict[str, Any] = {"finished_at": _now(), "error": None}
            elif rerun and attempts < MAX_ATTEMPTS:
                outcome = JobStatus.queued
                values = {"samples_done": 0, "phases": None, "lease_owner": None, "lease_expires_at": None}
            else:
                outcome = JobStatus.failed
                detail = INTERRUPTED + (f" (after {attempts} attempts)" if rerun else "")
                problem = Problem(type="https://bnrecal.dev/problems/interrupted", title="Interrupted", status=500,
                                  detail=detail)
                values = outcome_values(problem)
            if self._update(job_id, running, *expired, status=outcome.value, **values):
                outcomes[job_id] = outcome
        return outcomes

    def _update(self, job_id: str, allowed: set[JobStatus], *conditions: Any, **values: Any) -> bool:
        """Change a job only while it is in one of the ``allowed`` statuses (and meets any further
        ``conditions``); bump its revision."""
        statement = (
            sql_update(JobRow)
            .where(JobRow.id == job_id, JobRow.status.in_([status.value for status in allowed]), *conditions)
            .values(revision=JobRow.revision + 1, **values)
        )
        with self._session() as session:
            return session.execute(statement).rowcount == 1

    @staticmethod
    def _check_queued(session: Session, tenant: str, max_queued: int) -> None:
        """Refuse (rolling the insert back) a job that made the tenant's queue longer than allowed."""
        query = select(func.count()).select_from(JobRow).where(
            JobRow.tenant == tenant, JobRow.status == JobStatus.queued.value
        )
        if (session.scalar(query) or 0) > max_queued:
            raise TooManyJobsError(
                f"this API key already has {max_queued} queued jobs, the most it may have "
                "(BNRECAL_TENANT_MAX_QUEUED_JOBS); retry once some have started, or cancel some"
            )

    def _by_idempotency_key(self, tenant: str, key: str) -> JobRecord | None:
        with self._session() as session:
            row = session.scalar(select(JobRow).where(JobRow.tenant == tenant, JobRow.idempotency_key == key))
            return row.record() if row is not None else None

    @staticmethod
    def _same_spec(job: JobRecord, spec: dict[str, Any]) -> JobRecord:
        if job.spec != spec:
            raise ConflictError(
                f"Idempotency-Key {job.idempotency_key!r} was already used for job {job.id} with another spec"
            )
        return job

