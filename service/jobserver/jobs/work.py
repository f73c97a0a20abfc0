"""One server job's driver work, as the job host runs it: recalibrate, export, write the files.

The files go into the job's work folder; the server adopts them as the tenant's blobs.
Progress and phases go to ``report`` as (done, total, phase) events, (None, None, phase)
for a phase without samples.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bnrecal.workers.ranks.pool import WarmPool

from bnrecal.service.export.int8.options import int8_options
from bnrecal.service.run.core import check_cancel
from bnrecal.service.run.options import ExportOptions
from bnrecal.service.run.outputs import RunOutputs
from bnrecal.service.run.recalibrate import RecalibrationRequest, RunFiles, recalibrate_to_files
from bnrecal.service.run.report_html import JobLabel

from bnrecal.service.settings import Settings
from bnrecal.service.jobserver.jobs.spec import JobSpec

OCTET_STREAM = "application/octet-stream"

Event = tuple[int | None, int | None, str]
"""A job's progress as the host reports it: (samples done, samples total, phase), or
(None, None, phase) when the job entered a phase without samples (exporting, writing)."""


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
    into ``workdir`` (``recalibrate_to_files``, as ``bnrecal calibrate`` does): the
    artifacts' files and the report (which names its job, with a ``label``)."""
    check_cancel(cancel)
    workdir.mkdir(parents=True, exist_ok=True)
    if request.max_retries is None:  # a server job rides out a lost rank by default (docs/api.md)
        request = request.model_copy(update={"max_retries": settings.job_max_retries})
    int8 = "onnx_int8" in spec.outputs
    outputs = RunOutputs(
        onnx=workdir / "recalibrated.onnx" if "onnx" in spec.outputs else None,
        int8=workdir / "recalibrated-int8.onnx" if int8 else None,
        export=ExportOptions(
            opset=spec.onnx.opset, dtype=spec.onnx.dtype, dynamic_batch=spec.onnx.dynamic_batch,
            input_shape=tuple(spec.onnx.input_shape) if spec.onnx.input_shape is not None else None,
        ),
        int8_options=int8_options(spec.int8) if int8 else None,
    )
    run_files = RunFiles(report=workdir / "report.json", report_html=workdir / "report.html", job=label)
    result = recalibrate_to_files(request, settings, outputs, run_files, on_progress=_events(report), cancel=cancel,
                                  pool=pool)
    files: dict[str, tuple[Path, str]] = {}
    if outputs.onnx is not None:
        files["onnx"] = (outputs.onnx, OCTET_STREAM)
    if outputs.int8 is not None and result.int8_failed is None:  # else no INT8 artifact; the report says why
        files["onnx_int8"] = (outputs.int8, OCTET_STREAM)
    for name in ("checkpoint", "program"):  # named by what was uploaded: .pt, .safetensors, .pt2
        if name in spec.outputs:
            model_file = workdir / f"recalibrated{result.loaded.suffix}"
            result.save_model(model_file)
            files[name] = (model_file, OCTET_STREAM)
    files["report"] = (workdir / "report.json", "application/json")
    files["report.html"] = (workdir / "report.html", "text/html; charset=utf-8")
    return JobFiles(files, result.report.to_dict())


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

