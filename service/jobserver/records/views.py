"""The job as the API shows it (``GET /v1/jobs/{id}``): its status, progress, artifacts and
inputs, typed for the server that writes it and the client that reads it. Plain pydantic:
the HTTP client imports it without the service's run stack (torch, Ray)."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from bnrecal.service.jobserver.problems import Problem


class JobStatus(str, enum.Enum):
    """Where a job is; ``succeeded``, ``failed`` and ``cancelled`` are final."""

    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """Whether the job can no longer change."""
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})


class Progress(BaseModel):
    """What a job is doing and how far it got: the samples done of the phase's total
    (from the start of the job for calibration, from its start for evaluation)."""

    samples_done: int
    samples_total: int | None
    phase: str | None = Field(
        default=None,
        description="starting workers, calibrating, evaluating, exporting or writing (null before the job runs)",
    )


class Artifact(BaseModel):
    """A job output, stored as a blob of the job's tenant."""

    digest: str
    size: int
    filename: str
    media_type: str


class PhaseEntry(BaseModel):
    """A phase a job's run entered, and when (as the ledger keeps them; the API shows each as
    a :class:`PhaseTime`)."""

    phase: str
    at: datetime


class InputFile(BaseModel):
    """A blob the spec names, with the file name it was uploaded with (null without one)."""

    digest: str
    filename: str | None


class PhaseTime(BaseModel):
    """A phase the job went through: when it began, and how long it took (null while it lasts)."""

    phase: str
    started_at: datetime
    seconds: float | None


class JobView(BaseModel):
    """The job resource (``GET /v1/jobs/{id}``)."""

    id: str
    status: JobStatus
    spec: dict[str, Any]
    progress: Progress
    error: Problem | None
    artifacts: dict[str, Artifact]
    report: dict[str, Any] | None
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    inputs: dict[str, InputFile] = Field(
        default_factory=dict,
        description="The uploaded blobs the spec names (checkpoint, program, data, eval.data), with their file names.",
    )
    phases: list[PhaseTime] = Field(default_factory=list, description="The phases of the job's last run, in order.")
    revision: int = Field(
        default=1, description="Grows with every change of the job: of two views, the higher is the newer."
    )


class JobList(BaseModel):
    """A page of the tenant's jobs, newest first; ``next_cursor`` (null on the last page)
    is passed as ``cursor`` to get the next, older page."""

    jobs: list[JobView]
    next_cursor: str | None = None
