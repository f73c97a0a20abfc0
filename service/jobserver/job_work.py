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

from bnrecal.errors import CancelledError
from bnrecal.workers.ranks.pool import WarmPool

from bnrecal.service.run.exporting import export_recalibrated
from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate
from bnrecal.service.run.report_html import job_section, write_html_report

from ..settings import Settings
from .jobs import JobSpec

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
    _check_cancel(cancel)
    workdir.mkdir(parents=True, exist_ok=True)
    if request.max_retries is None:  # a server job rides out a lost rank by default (docs/api.md)
        request = request.model_copy(update={"max_retries": settings.job_max_retries})
    if "onnx_int8" in spec.outputs:  # keep_float/op_types against the graph, before any calibration (docs/int8.md)
        from bnrecal.service.export.int8.options import int8_options
        from bnrecal.service.run.int8_names import check_int8_names

        check_int8_names(request, settings, int8_options(spec.int8), opset=spec.onnx.opset)
    result = recalibrate(
        request, settings, on_progress=lambda done, total, phase: report((done, total, phase)),
        cancel=cancel, pool=pool,
    )
    summary = result.report
    files: dict[str, tuple[Path, str]] = {}
    if "onnx" in spec.outputs:
        _check_cancel(cancel)
        report((None, None, "exporting"))
        onnx_file = workdir / "recalibrated.onnx"
        options = spec.onnx
        summary.onnx = export_recalibrated(
            result, onnx_file, opset=options.opset, dtype=options.dtype,
            dynamic_batch=options.dynamic_batch, input_shape=options.input_shape,
        )
        files["onnx"] = (onnx_file, OCTET_STREAM)
    if "onnx_int8" in spec.outputs:
        from bnrecal.service.export.int8.options import int8_options
        from bnrecal.service.run.int8 import quantize_recalibrated

        _check_cancel(cancel)
        report((None, None, "quantizing to INT8"))
        int8_file = workdir / "recalibrated-int8.onnx"
        onnx_options = spec.onnx
        fp32 = files["onnx"][0].read_bytes() if "onnx" in files and onnx_options.dtype == "float32" else None
        from bnrecal.errors import Int8GuardError

        try:
            summary.int8 = quantize_recalibrated(
                result, request, settings, int8_file, int8_options(spec.int8), fp32_model=fp32,
                export_options={
                    "opset": onnx_options.opset, "dynamic_batch": onnx_options.dynamic_batch,
                    "input_shape": onnx_options.input_shape,
                },
                pool=pool, cancel=cancel, on_phase=lambda phase: report((None, None, phase)),
            )
            files["onnx_int8"] = (int8_file, OCTET_STREAM)
        except Int8GuardError as failed:  # no INT8 artifact; the others and the report saying why (docs/int8.md)
            summary.int8 = failed.section
    _check_cancel(cancel)
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


def _check_cancel(cancel: threading.Event) -> None:
    if cancel.is_set():
        raise CancelledError("the job was cancelled")
