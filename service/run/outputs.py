"""The files a run makes after its statistics: the folded ONNX export (docs/onnx.md) and
the INT8 file (docs/int8.md), later phases of the same run (``service.run.core``) for the
command line and the job server alike.

They run on the run's executor while its world is up: the INT8 ranges are gathered by the
statistics' ranks (warm from the pool), over the samples the statistics were computed on,
under the run's failure policy. Each surface only says where the files go.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bnrecal.errors import Int8GuardError
from bnrecal.workers.ranks.int8_ranges import RangeRequest
from bnrecal.workers.ranks.plan import GroupRanges

from bnrecal.service.export.int8.checks import Scorer
from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.run.core import Executor, FailurePolicy, ProgressCallback, check_cancel
from bnrecal.service.run.exporting import export_recalibrated
from bnrecal.service.run.int8 import VERIFY_SAMPLES, quantize_recalibrated
from bnrecal.service.run.options import ExportOptions
from bnrecal.service.run.recalibration import Recalibration, RecalibrationRequest
from bnrecal.service.run.report import Report, add_to_timeline, where_ranks_ran

HOST = "host"
EXPORTING_PHASE = "exporting"
QUANTIZING_PHASE = "quantizing to INT8"


@dataclass(frozen=True)
class RunOutputs:
    """Which files a run makes beyond the statistics, and where: ``onnx`` (the folded FP32
    or FP16 export, by ``export``) and ``int8`` (the INT8 QDQ file, by ``int8_options``;
    its FP32 base is the ONNX export when that is float32, else one made by ``export``)."""

    onnx: Path | None = None
    int8: Path | None = None
    export: ExportOptions = ExportOptions()
    int8_options: Int8Options | None = None

    def __post_init__(self) -> None:
        if self.int8 is not None and self.int8_options is None:
            raise ValueError("an INT8 output needs its Int8Options")

    @property
    def any(self) -> bool:
        """Whether there is anything to make."""
        return self.onnx is not None or self.int8 is not None


def make_outputs(
    result: Recalibration,
    request: RecalibrationRequest,
    outputs: RunOutputs,
    executor: Executor,
    policy: FailurePolicy,
    *,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> None:
    """Write ``outputs`` for a finished recalibration, setting the report's ``onnx`` and
    ``int8`` sections. An INT8 file that fails its guard is not written: the report says
    why and ``result.int8_failed`` holds the error, for the surface to raise once the other
    outputs are kept (docs/int8.md). Any other failure raises (``ExportError``, ``RunError``)."""
    progress = on_progress or (lambda done, total, phase: None)
    if outputs.onnx is not None:
        check_cancel(cancel)
        progress(0, None, EXPORTING_PHASE)
        export, started = outputs.export, time.monotonic()
        result.report.onnx = export_recalibrated(
            result, outputs.onnx, opset=export.opset, dtype=export.dtype, dynamic_batch=export.dynamic_batch,
            input_shape=export.input_shape,
        )
        verified = max(result.report.onnx.get("verified_batches") or [0])
        add_to_timeline(result.report, "ONNX export and its checks", time.monotonic() - started, verified, 0, HOST)
    if outputs.int8 is not None:
        assert outputs.int8_options is not None
        check_cancel(cancel)
        progress(0, None, QUANTIZING_PHASE)
        started = time.monotonic()
        on_ranks = _make_int8(result, request, outputs, executor, policy, progress, cancel)
        add_to_timeline(result.report, "INT8 quantizing and checks", time.monotonic() - started - on_ranks,
                        VERIFY_SAMPLES, 0, HOST)


def _make_int8(
    result: Recalibration, request: RecalibrationRequest, outputs: RunOutputs, executor: Executor,
    policy: FailurePolicy, progress: ProgressCallback, cancel: threading.Event | None,
) -> float:
    """The INT8 phase: ranges and scores on the run's ranks, the file, its report section;
    returns the seconds its passes on the ranks took (each in the report's timeline)."""
    assert outputs.int8 is not None and outputs.int8_options is not None
    float32_base = outputs.onnx is not None and outputs.export.dtype == "float32"
    failures: list[str] = []
    # The ranges are gathered over the samples the statistics were computed on (docs/int8.md,
    # "How the ranges are gathered"): with max_samples "auto", the prefix of the order where
    # they converged.
    report, where = result.report, where_ranks_ran(result.report)
    spent = [0.0]
    ranges = executor.range_gatherer(
        result.dataset, request.batch_size, int(report["samples"]), policy=policy, failures=failures,
        on_phase=lambda phase: progress(0, None, phase), cancel=cancel,
    )

    def gather(model: bytes, range_request: RangeRequest) -> GroupRanges:
        started = time.monotonic()
        gathered = ranges(model, range_request)
        took = time.monotonic() - started
        spent[0] += took
        passes = gathered.collectives[0] if gathered.collectives else 0  # a histogram method reads the data twice
        add_to_timeline(report, "INT8 ranges", took, sum(gathered.samples) * passes, passes, where)
        return gathered

    evaluation, score = result.evaluation, None
    if evaluation is not None and evaluation.labels is not None and evaluation.target.labelled:
        score = _Timed(executor.scorer(
            evaluation, policy=policy, failures=failures, on_phase=lambda phase: progress(0, None, phase), cancel=cancel,
        ), report, where, spent)
    try:
        section = quantize_recalibrated(
            result, request, outputs.int8, outputs.int8_options, gather, score=score,
            fp32_model=outputs.onnx.read_bytes() if float32_base else None,  # type: ignore[union-attr]
            export_options=outputs.export, cancel=cancel, on_phase=lambda phase: progress(0, None, phase),
        )
    except Int8GuardError as failed:  # the other outputs are still written (docs/int8.md)
        result.report.int8, result.int8_failed = failed.section, failed
        return spent[0]
    section["attempts"] = len(failures) + 1  # attempts of its passes on the ranks, as the report's top level counts
    section["retried_failures"] = failures
    result.report.int8 = section
    return spent[0]


class _Timed:
    """A scorer whose passes are counted in the report's timeline."""

    def __init__(self, score: Scorer, report: Report, where: str, spent: list[float]) -> None:
        self.score, self.report, self.where, self.spent = score, report, where, spent
        self.samples = score.samples

    def __call__(self, models: Sequence[bytes], part: str = "all") -> list[dict[str, float]]:
        started = time.monotonic()
        scores = self.score(models, part)
        took = time.monotonic() - started
        self.spent[0] += took
        add_to_timeline(self.report, "INT8 evaluations", took, self.samples if models else 0, 1 if models else 0,
                        self.where)
        return scores
