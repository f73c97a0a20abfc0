"""What the job commands print about a job: the ``bnrecal jobs`` table, the ``status`` lines,
and the one time format the user reads (ISO 8601 with the zone, to the second)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from ..jobserver.records.views import JobView
from .console import evaluation_line

HEADER = ("ID", "STATUS", "PHASE OR RESULT", "CREATED", "MODEL", "DATA")
INPUT_FIELDS = ("data", "eval.data")
_WIDEST_CELL = 60
"""A cell (a failure title, a file name) is cut to this many characters so rows stay rows."""


def iso_time(moment: datetime | None) -> str:
    """A server time as this machine's local time, ISO 8601 with its zone, to the second:
    ``2026-11-25T03:34:26+00:00``. Empty for no time."""
    if moment is None:
        return ""
    return moment.astimezone().isoformat(timespec="seconds")


def model_name(job: JobView) -> str:
    """What a job recalibrates: the architecture, or ``program <file name>``."""
    spec = job.spec
    if spec.get("arch"):
        return str(spec["arch"])
    return f"program {input_name(job, 'program')}".strip() if spec.get("program") else ""


def input_name(job: JobView, field: str) -> str:
    """The name of one of a job's inputs: the file name it was uploaded with, else its path,
    URI or short digest."""
    uploaded = job.inputs.get(field)
    if uploaded:
        return uploaded.filename or f"{uploaded.digest[:19]}..."
    spec = job.spec
    source = (spec.get("eval") or {}).get("data") if field == "eval.data" else spec.get(field)
    if isinstance(source, dict):
        return str(source.get("path") or source.get("uri") or "")
    return f"{str(source)[:19]}..." if source else ""


def data_names(job: JobView) -> str:
    """The calibration data's name, and the evaluation data's after a ``+``."""
    return " + ".join(name for name in (input_name(job, field) for field in INPUT_FIELDS) if name)


def progress_text(job: JobView) -> str:
    """``calibrating 64/1437`` while a phase counts samples; the phase alone where none applies."""
    phase = job.progress.phase or job.status.value
    done, total = job.progress.samples_done, job.progress.samples_total
    counted = phase in ("calibrating", "evaluating")
    return f"{phase} {done}/{total}" if total and counted else phase


def result_text(job: JobView) -> str:
    """What a finished job came to: samples and accuracy, the failure's title, or ``cancelled``."""
    if job.status == "failed":
        return f"failed: {job.error.title if job.error is not None else 'error'}"
    if job.status == "cancelled":
        return "cancelled"
    report = job.report or {}
    parts = [f"{report['samples']} samples" if "samples" in report else "done"]
    evaluation = report.get("evaluation") or {}
    before, after = evaluation.get("before"), evaluation.get("after")
    if before and after and "top1" in before:
        parts.append(f"top-1 {before['top1']:.3f} -> {after['top1']:.3f}")
    return ", ".join(parts)


def phase_or_result(job: JobView) -> str:
    """The table's third column: where a live job is, or what a finished one came to."""
    return result_text(job) if job.status.is_terminal else progress_text(job)


def job_row(job: JobView) -> tuple[str, ...]:
    """One job as the cells of a table row, in ``HEADER`` order."""
    cells = (job.id, job.status.value, phase_or_result(job), iso_time(job.created_at), model_name(job), data_names(job))
    return tuple(_cut(cell) for cell in cells)


def job_table(jobs: Sequence[JobView]) -> list[str]:
    """The ``bnrecal jobs`` table: a header, then one aligned row per job (newest first as given)."""
    rows = [HEADER, *(job_row(job) for job in jobs)]
    widths = [max(len(row[column]) for row in rows) for column in range(len(HEADER))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def status_lines(job: JobView) -> list[str]:
    """The lines ``bnrecal status`` prints for a job."""
    spec = job.spec
    lines = [
        f"job {job.id}: {job.status.value}",
        f"model {model_name(job)}, {spec.get('workers')} worker(s), {spec.get('mode')} mode, "
        f"batch {spec.get('batch_size')}",
    ]
    if data_names(job):
        lines.append(f"data {data_names(job)}")
    times = [("created", iso_time(job.created_at)), ("started", iso_time(job.started_at)),
             ("finished", iso_time(job.finished_at))]
    lines.append(", ".join(f"{name} {value}" for name, value in times if value))
    if not job.status.is_terminal:
        lines.append(f"progress: {progress_text(job)}")
    error = job.error
    if error is not None:
        field = f" (field {error.field})" if error.field else ""
        lines.append(f"error: {error.title}: {error.detail}{field}")
    report = job.report
    if report:
        lines.append(f"recalibrated {len(report['layers'])} BN layers on {report['samples']} samples "
                     f"in {report['seconds']:.2f} s")
        if report.get("evaluation"):
            lines.append(evaluation_line(report["evaluation"]))
    if job.artifacts:
        lines.append("artifacts: " + ", ".join(sorted(job.artifacts)))
    return lines


def _cut(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _WIDEST_CELL else text[: _WIDEST_CELL - 3] + "..."
