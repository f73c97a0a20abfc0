"""One job as the ledger holds it: the stored spec, its status and outcome, and the public
resource it shows as (docs/api.md, "Jobs")."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from bnrecal.service.jobserver.problems import Problem
from bnrecal.service.jobserver.records.spec import spec_digests
from bnrecal.service.jobserver.records.views import (
    Artifact, InputFile, JobStatus, JobView, PhaseEntry, PhaseTime, Progress,
)


@dataclass(frozen=True)
class JobRecord:
    """One job as the ledger holds it (a snapshot, safe to pass between threads)."""

    id: str
    tenant: str
    status: JobStatus
    spec: dict[str, Any]
    idempotency_key: str | None
    attempts: int
    cancel_requested: bool
    samples_done: int
    samples_total: int | None
    phase: str | None
    error: Problem | None
    artifacts: dict[str, Artifact]
    report: dict[str, Any] | None
    revision: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    phases: list[PhaseEntry] = field(default_factory=list)

    def progress(self) -> Progress:
        """The job's progress as the API shows it."""
        return Progress(samples_done=self.samples_done, samples_total=self.samples_total, phase=self.phase)

    def input_digests(self) -> dict[str, str]:
        """The uploaded blobs the spec names, by field (``checkpoint``, ``data``, ``models[0].checkpoint``, ...)."""
        return spec_digests(self.spec)

    def phase_times(self) -> list[PhaseTime]:
        """Each phase of the last run with its duration: until the next phase began, the last
        one until the job finished (null while the job is still in it)."""
        times: list[PhaseTime] = []
        for index, entry in enumerate(self.phases):
            began = entry.at
            ended = self.phases[index + 1].at if index + 1 < len(self.phases) else None
            if ended is None and self.status.is_terminal:
                ended = self.finished_at
            seconds = round(max(0.0, (ended - began).total_seconds()), 3) if ended is not None else None
            times.append(PhaseTime(phase=entry.phase, started_at=began, seconds=seconds))
        return times

    def view(self, filenames: dict[str, str | None] | None = None) -> JobView:
        """The public resource (no tenant, no idempotency key); ``filenames`` maps the input
        digests to the names they were uploaded with."""
        names = filenames or {}
        return JobView(
            id=self.id,
            status=self.status,
            spec=self.spec,
            progress=self.progress(),
            error=self.error,
            artifacts=dict(self.artifacts),
            report=self.report,
            attempts=self.attempts,
            created_at=self.created_at,
            started_at=self.started_at,
            finished_at=self.finished_at,
            inputs={
                name: InputFile(digest=digest, filename=names.get(digest))
                for name, digest in self.input_digests().items()
            },
            phases=self.phase_times(),
            revision=self.revision,
        )
