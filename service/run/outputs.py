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
from dataclasses import dataclass
from pathlib import Path

from bnrecal.errors import Int8GuardError
from bnrecal.workers.engine.evaluation import EvalMetrics
from bnrecal.workers.ranks.plan import GroupPass

from bnrecal.service.export.graph_reuse import GraphReuse
from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.run.core import Executor, FailurePolicy, ProgressCallback, check_cancel
from bnrecal.service.run.exporting import export_recalibrated, scores_output
from bnrecal.service.export.verification import VERIFY_SAMPLES
from bnrecal.service.run.int8 import fp32_bytes_for, quantize_export
from bnrecal.service.run.options import ExportOptions
from bnrecal.service.run.recalibration import Recalibration, RecalibrationRequest
from bnrecal.service.run.report import ONNX_RUNTIME, DataSummary, EvaluationSection, add_to_timeline, where_ranks_ran

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
    reuse: GraphReuse | None = None,
) -> None:
    """Write ``outputs`` for a finished recalibration, setting the report's ``onnx`` and
    ``int8`` sections. An INT8 file that fails its guard is not written: the report says
    why and ``result.int8_failed`` holds the error, for the surface to raise once the other
    outputs are kept (docs/int8.md). Any other failure raises (``ExportError``, ``RunError``).
    ``reuse`` holds the exporter's graph where the run traced it already (beside its statistics)."""
    progress = on_progress or (lambda done, total, phase: None)
    if reuse is None and outputs.int8 is not None:
        reuse = GraphReuse()  # one trace for the model and the stale one
    if outputs.onnx is not None:
        check_cancel(cancel)
        progress(0, None, EXPORTING_PHASE)
        export, started, read = outputs.export, time.monotonic(), result.read_here
        result.report.onnx = export_recalibrated(
            result, outputs.onnx, opset=export.opset, dtype=export.dtype, dynamic_batch=export.dynamic_batch,
            input_shape=export.input_shape, reuse=reuse,
        )
        add_to_timeline(result.report, "ONNX export and its checks", time.monotonic() - started,
                        result.read_here - read, 0, HOST)
    if outputs.int8 is not None:
        assert outputs.int8_options is not None and reuse is not None
        check_cancel(cancel)
        progress(0, None, QUANTIZING_PHASE)
        started, read = time.monotonic(), result.read_here
        on_ranks = _make_int8(result, request, outputs, executor, policy, reuse, progress, cancel)
        add_to_timeline(result.report, "INT8 FP32 exports", time.monotonic() - started - on_ranks,
                        result.read_here - read, 0, HOST)


def _make_int8(
    result: Recalibration, request: RecalibrationRequest, outputs: RunOutputs, executor: Executor,
    policy: FailurePolicy, reuse: GraphReuse,
    progress: ProgressCallback, cancel: threading.Event | None,
) -> float:
    """The INT8 phase: its passes on the run's ranks, the file, its report section (and the
    evaluation before and after, when it was left to this phase); returns the seconds its
    passes took (each in the report's timeline)."""
    assert outputs.int8 is not None and outputs.int8_options is not None
    failures: list[str] = []
    report, where = result.report, where_ranks_ran(result.report)
    spent = [0.0]

    def record(phase: str, done: GroupPass) -> None:
        spent[0] += done.seconds
        reads = done.collectives[0] if done.collectives else 0  # each read of the samples ends in one collective
        add_to_timeline(report, phase, done.seconds, sum(done.samples) * reads, reads, where)

    # The ranges are gathered over the samples the statistics were computed on (docs/int8.md,
    # "How the ranges are gathered"): with max_samples "auto", the prefix of the order where
    # they converged.
    passes = executor.onnx_passes(
        result.dataset, request.batch_size, int(report["samples"]), result.evaluation, policy=policy,
        failures=failures, on_phase=lambda phase: progress(0, None, phase), cancel=cancel, record=record,
    )
    evaluation = result.evaluation if result.evaluation_later else None
    export = outputs.export
    kwargs = {"opset": export.opset, "dynamic_batch": export.dynamic_batch, "input_shape": export.input_shape,
              "reuse": reuse}
    if outputs.onnx is not None and export.dtype == "float32":
        fp32 = outputs.onnx.read_bytes()
    else:
        fp32 = fp32_bytes_for(lambda scratch: export_recalibrated(result, scratch, **kwargs))
    stale = None
    if passes.labelled or evaluation is not None:  # what recalibrating bought: the stale model, alike
        stale_model = result.stale_model()
        stale = fp32_bytes_for(lambda scratch: export_recalibrated(result, scratch, model=stale_model, openvino=False,
                                                                   **kwargs))

    def evaluated(metrics: EvalMetrics, seconds: float) -> None:
        assert evaluation is not None
        report.evaluation = EvaluationSection.of(DataSummary.of(evaluation.dataset.summary()), metrics,
                                                 seconds, ONNX_RUNTIME)

    def worked() -> None:  # the quantizer's own work, where the passes ran
        spent[0] += passes.work_seconds
        add_to_timeline(report, "INT8 quantizer and checks", passes.work_seconds, 0, 0, where)

    try:
        quantized = quantize_export(
            fp32, outputs.int8_options, passes, result.calibration_samples(VERIFY_SAMPLES), stale_fp32_model=stale,
            compare=evaluation.target if evaluation is not None else None, on_evaluation=evaluated,
            output=scores_output(result.model, result.calibration_samples(1)),
            on_phase=lambda phase: progress(0, None, phase),
        )
    except Int8GuardError as failed:  # the other outputs are still written (docs/int8.md)
        worked()
        result.report.int8, result.int8_failed = failed.section, failed
        return spent[0]
    worked()
    check_cancel(cancel)
    quantized.write(outputs.int8)
    section = quantized.section
    section.attempts = len(failures) + 1  # attempts of its passes on the ranks, as the report's top level counts
    section.retried_failures = failures
    result.report.int8 = section
    return spent[0]
