"""The ledger's one SQL table, ``jobs``: a row per job, its columns and their types, and the
detached :class:`JobRecord` a row reads back as. The JSON columns a job's outcome writes (its
problem, artifacts and phases) read back as typed objects; the spec and the report stay the
JSON they were stored as (the spec as submitted, the report of the release that wrote it)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import TypeAdapter
from sqlalchemy import JSON, DateTime, Integer, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from bnrecal.service.jobserver.records.record import JobRecord
from bnrecal.service.jobserver.records.views import Artifact, JobStatus, PhaseEntry
from bnrecal.service.jobserver.problems import Problem


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored naive in UTC and read back timezone-aware."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        return value.astimezone(UTC).replace(tzinfo=None) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return value.replace(tzinfo=UTC) if value is not None else None


class _TypedJSON(TypeDecorator[Any]):
    """A JSON column holding typed objects: stored as their JSON, validated as they are read
    back (a row no release of bnrecal could have written fails loudly, naming the type)."""

    impl = JSON
    cache_ok = True  # each subclass says so again: SQLAlchemy reads it from the class's own body
    adapter: ClassVar[TypeAdapter[Any]]

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        if value is None:
            return None
        return self.adapter.dump_python(self.adapter.validate_python(value), mode="json")  # what cannot be read back is not written

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        return None if value is None else self.adapter.validate_python(value)


class ProblemJSON(_TypedJSON):
    """A failed job's :class:`Problem`."""

    adapter = TypeAdapter(Problem)
    cache_ok = True


class ArtifactsJSON(_TypedJSON):
    """A job's artifacts by name."""

    adapter = TypeAdapter(dict[str, Artifact])
    cache_ok = True


class PhasesJSON(_TypedJSON):
    """The phases a job's last run entered, in order."""

    adapter = TypeAdapter(list[PhaseEntry])
    cache_ok = True


class Base(DeclarativeBase):
    pass


class JobRow(Base):
    """One job; ``seq`` orders the FIFO queue."""

    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(32), unique=True, index=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    samples_done: Mapped[int] = mapped_column(Integer, default=0)
    samples_total: Mapped[int | None] = mapped_column(Integer, nullable=True)
    phase: Mapped[str | None] = mapped_column(String(32), nullable=True)
    error: Mapped[Problem | None] = mapped_column(ProblemJSON, nullable=True)
    artifacts: Mapped[dict[str, Artifact]] = mapped_column(ArtifactsJSON, default=dict)
    report: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    revision: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    phases: Mapped[list[PhaseEntry] | None] = mapped_column(PhasesJSON, nullable=True)
    lease_owner: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the replica running it
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    def record(self) -> JobRecord:
        """A detached snapshot of this row."""
        return JobRecord(
            id=self.id,
            tenant=self.tenant,
            status=JobStatus(self.status),
            spec=dict(self.spec),
            idempotency_key=self.idempotency_key,
            attempts=self.attempts,
            cancel_requested=self.cancel_requested,
            samples_done=self.samples_done,
            samples_total=self.samples_total,
            phase=self.phase,
            error=self.error,
            artifacts=dict(self.artifacts or {}),
            report=self.report,
            revision=self.revision,
            created_at=self.created_at,
            started_at=self.started_at,
            finished_at=self.finished_at,
            phases=list(self.phases or []),
        )
