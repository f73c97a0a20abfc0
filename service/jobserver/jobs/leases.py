"""Job leases: how N replicas sharing one ledger run each job exactly once.

A replica starts a queued job by *claiming* it in the ledger: one conditional update
(on Postgres after ``SELECT ... FOR UPDATE SKIP LOCKED``, so replicas racing for the same
job do not queue up behind each other's row lock) moves it to ``running`` with the
replica's id as ``lease_owner`` and a ``lease_expires_at`` ``BNRECAL_JOB_LEASE_S`` ahead.
While the job runs, the replica *renews* the lease every third of that; a renewal also
reads ``cancel_requested``, which is how a cancel sent to another replica reaches the
running one. A replica that dies stops renewing; once the lease has run out, any replica
puts the job back in the queue (counting the attempt, as after a crash) and one of them
runs it again from the start. The job's outcome is written only while the lease is
still the writer's, so a replica that lost its lease (paused past it) cannot overwrite
the run that replaced it; its half-written artifacts were never recorded.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy import update as sql_update

from bnrecal.errors import InsufficientStorageError

from bnrecal.service.jobserver.records.record import JobRecord
from bnrecal.service.jobserver.records.views import Artifact, JobStatus
from bnrecal.service.jobserver.ledger import JobRow, Ledger, outcome_values, start_values
from bnrecal.service.jobserver.problems import Problem
from bnrecal.service.jobserver.ledger.engines import is_postgres

log = logging.getLogger("bnrecal.leases")


def replica_id() -> str:
    """This process's name in the ledger's leases: host, pid and a random part (a restarted
    process with a recycled pid is another replica)."""
    return f"{socket.gethostname()[:32]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Renewal:
    """What a renewal found: whether the lease is still this replica's, and whether the job
    was asked to stop meanwhile (on any replica)."""

    held: bool
    cancel_requested: bool


class JobLeases:
    """The lease queries of one replica (``owner``) on a ledger."""

    def __init__(self, ledger: Ledger, owner: str, lease_s: float) -> None:
        self.ledger = ledger
        self.owner = owner
        self.lease_s = lease_s

    def _expiry(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.lease_s)

    def claim(self, job_id: str) -> JobRecord | None:
        """Start a queued job under this replica's lease (counting the attempt); None if it is no
        longer queued, or another replica is claiming it right now."""
        values = start_values() | {
            "revision": JobRow.revision + 1, "lease_owner": self.owner, "lease_expires_at": self._expiry(),
        }
        queued = (JobRow.id == job_id, JobRow.status == JobStatus.queued.value)
        with self.ledger._sessions.begin() as session:
            if is_postgres(self.ledger.engine):
                locked = session.scalar(select(JobRow.seq).where(*queued).with_for_update(skip_locked=True))
                if locked is None:
                    return None
            if session.execute(sql_update(JobRow).where(*queued).values(**values)).rowcount != 1:
                return None
        return self.ledger.get_any(job_id)

    def renew(self, job_id: str) -> Renewal:
        """Push a running job's lease forward (no new revision: nothing a client sees changed)."""
        mine = (JobRow.id == job_id, JobRow.status == JobStatus.running.value, JobRow.lease_owner == self.owner)
        with self.ledger._sessions.begin() as session:
            held = session.execute(
                sql_update(JobRow).where(*mine).values(lease_expires_at=self._expiry())
            ).rowcount == 1
            cancel = session.scalar(select(JobRow.cancel_requested).where(JobRow.id == job_id))
        return Renewal(held=held, cancel_requested=bool(cancel))

    def finish(
        self, job_id: str, status: JobStatus, *, error: Problem | None = None,
        artifacts: dict[str, Artifact] | None = None, report: dict[str, Any] | None = None,
    ) -> bool:
        """Write a job's outcome (``error``, ``artifacts``, ``report``) if this replica still holds its lease."""
        assert status.is_terminal
        return self.ledger._update(
            job_id, {JobStatus.running}, JobRow.lease_owner == self.owner, status=status.value,
            **outcome_values(error, artifacts, report),
        )

    def requeue(self, job_id: str) -> bool:
        """Put a running job back in the queue, its attempt not counted (this replica stops), if
        this replica still holds its lease."""
        return self.ledger.requeue(job_id, JobRow.lease_owner == self.owner)

    def finish_making_room(self, job_id: str, status: JobStatus, workdir: Path, **outcome: Any) -> bool:
        """Write a job's outcome as :meth:`finish` does, never raising; whether it was written
        (not where the lease is no longer this replica's). On a full disk the job's work dir
        (what the job itself wrote) is removed to make room and the write tried once more, so a
        job that filled the disk still ends with its 507. An outcome that still cannot be
        written is logged: the lease, no longer renewed, runs out and the job is taken over
        like a dead replica's."""
        for attempt in range(2):
            try:
                return self.finish(job_id, status, **outcome)
            except InsufficientStorageError:
                if attempt == 0:
                    shutil.rmtree(workdir, ignore_errors=True)
                    continue
                log.error("job %s: the disk is full; its outcome (%s) was not written", job_id, status.value)
            except Exception:  # noqa: BLE001 - the ledger unreachable: the lease takes it from here
                log.exception("job %s: its outcome (%s) was not written", job_id, status.value)
                break
        return False

    def take_over_expired(self, rerun: bool) -> dict[str, JobStatus]:
        """Queue again once (or fail, or end as cancelled) each running job whose lease ran out:
        its replica died. Returns the outcomes."""
        return self.ledger.recover_interrupted(rerun, expired_before=datetime.now(UTC))
