"""One server job's driver work, as the job host runs it: recalibrate, export, write the files.

The files go into the job's work folder; the server adopts them as the tenant's blobs.
Progress and phases go to ``report`` as (done, total, phase) events, (None, None, phase)
for a phase without samples.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bnrecal.workers.ranks.pool import WarmPool

from bnrecal.service.export.int8.options import int8_options
from bnrecal.service.run.core import check_cancel
from bnrecal.service.run.options import ExportOptions
from bnrecal.service.run.outputs import RunOutputs
from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate
from bnrecal.service.run.report_html import job_section, write_html_report

from bnrecal.service.settings import Settings
from bnrecal.service.jobserver.jobs.spec import JobSpec

OCTET_STREAM = "application/octet-stream"

Event = tuple[int | None, int | None, str]
"""A job's progress as the host reports it: (samples done, samples total, phase), or
(None, None, phase) when the job entered a phase without samples (exporting, writing)."""


@dataclass(frozen=True)
class JobLabel:
    """What names a server job in its report (``report_html.job_section``): its id, when it
    was submitted, and its inputs (file name and digest by spec field)."""

    id: str
    submitted_at: datetime
    inputs: dict[str, dict[str, str | None]]


@dataclass(frozen=True)
class JobFiles:
    """What a job left in its work folder: artifact name -> (file, media type), and the report."""

    files: dict[str, tuple[Path, str]]
    report: dict[str, Any]


def run_job(
    request: RecalibrationRequest,
    settings: Settings,
    spec: JobSpec,
    workdir: Path,
    report: Callable[[Event], None],
    cancel: threading.Event,
    pool: WarmPool | None,
    label: JobLabel | None = None,
) -> JobFiles:
    """Recalibrate, export if asked, and write the model, ``report.json`` and ``report.html``
    into ``workdir``: the artifacts' files and the report (which names its job, with a ``label``)."""
    check_cancel(cancel)
    workdir.mkdir(parents=True, exist_ok=True)
    if request.max_retries is None:  # a server job rides out a lost rank by default (docs/api.md)
        request = request.model_copy(update={"max_retries": settings.job_max_retries})
    if "onnx_int8" in spec.outputs:  # keep_float/op_types against the graph, before any calibration (docs/int8.md)
        from bnrecal.service.run.int8_names import check_int8_names

        check_int8_names(request, settings, int8_options(spec.int8), opset=spec.onnx.opset)
    outputs = RunOutputs(
        onnx=workdir / "recalibrated.onnx" if "onnx" in spec.outputs else None,
        int8=workdir / "recalibrated-int8.onnx" if "onnx_int8" in spec.outputs else None,
        export=ExportOptions(
            opset=spec.onnx.opset, dtype=spec.onnx.dtype, dynamic_batch=spec.onnx.dynamic_batch,
            input_shape=tuple(spec.onnx.input_shape) if spec.onnx.input_shape is not None else None,
        ),
        int8_options=int8_options(spec.int8) if "onnx_int8" in spec.outputs else None,
    )
    result = recalibrate(request, settings, on_progress=_events(report), cancel=cancel, pool=pool, outputs=outputs)
    summary = result.report
    files: dict[str, tuple[Path, str]] = {}
    if outputs.onnx is not None:
        files["onnx"] = (outputs.onnx, OCTET_STREAM)
    if outputs.int8 is not None and result.int8_failed is None:  # else no INT8 artifact; the report says why
        files["onnx_int8"] = (outputs.int8, OCTET_STREAM)
    check_cancel(cancel)
    report((None, None, "writing"))
    for name in ("checkpoint", "program"):
        if name in spec.outputs:
            model_file = workdir / f"recalibrated{result.loaded.suffix}"
            result.save_model(model_file)
            files[name] = (model_file, OCTET_STREAM)
    if label is not None:  # the report names its job, and the hosts its ranks ran on
        summary.job = job_section(label.id, label.submitted_at, label.inputs, summary.nodes)
    report_file = workdir / "report.json"
    result.save_report(report_file)
    files["report"] = (report_file, "application/json")
    html_file = workdir / "report.html"
    write_html_report(summary, html_file)
    files["report.html"] = (html_file, "text/html; charset=utf-8")
    return JobFiles(files, summary.to_dict())


def _events(report: Callable[[Event], None]) -> Callable[[int, int | None, str], None]:
    """The run's progress as job events: a phase that counts no samples (exporting,
    quantizing) as (None, None, phase), once."""
    last: list[Event] = []

    def on_progress(done: int, total: int | None, phase: str) -> None:
        event: Event = (done, total, phase) if total is not None else (None, None, phase)
        if not last or last[0] != event:
            last[:] = [event]
            report(event)

    return on_progress

