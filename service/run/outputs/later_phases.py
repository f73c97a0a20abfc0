"""The files a run makes after its statistics: the folded ONNX export (docs/onnx.md) and
the INT8 file (docs/int8.md), later phases of the same run (``service.run.core``) for the
command line and the job server alike.

They run on the run's executor while its world is up: the INT8 ranges are gathered by the
statistics' ranks (warm from the pool), over the samples the statistics were computed on,
under the run's failure policy. Each surface only says where the files go.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from bnrecal.errors import Int8GuardError
from bnrecal.workers.engine.evaluation import EvalMetrics
from bnrecal.workers.ranks.plan import GroupPass

from bnrecal.workers.files import atomic_write

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.products import PRODUCT_NAMES
from bnrecal.service.run.core import Executor, ProgressCallback, RunControl
from bnrecal.service.run.outputs.exports import ExportAsk, ExportedFile, ExportWork, ModelBuild, export_batch, export_models
from bnrecal.service.export.verification import VERIFY_SAMPLES
from bnrecal.service.run.outputs.int8 import quantize_export
from bnrecal.service.run.outputs.onnx_passes import OnnxPasses, passes_on
from bnrecal.service.run.options import ExportOptions
from bnrecal.service.run.request import Recalibration, RecalibrationRequest
from bnrecal.service.run.report.document import ONNX_RUNTIME, DataSummary, EvaluationSection, add_to_timeline, where_ranks_ran

EXPORTING_PHASE = "exporting"
QUANTIZING_PHASE = "quantizing to INT8"


@dataclass(frozen=True)
class RunOutputs:
    """Which files a run makes beyond the statistics, and where: ``onnx`` (the folded FP32
    or FP16 export, by ``export``) and ``int8`` (the INT8 QDQ file, by ``int8_options``;
    its FP32 base is the ONNX export when that is float32, else one made by ``export``);
    ``openvino`` and ``openvino_int8``: OpenVINO's own files (the ``.xml`` path, its ``.bin``
    beside) of the FP32 export and of the INT8 file (``service.export.openvino_ir``)."""

    onnx: Path | None = None
    int8: Path | None = None
    export: ExportOptions = ExportOptions()
    int8_options: Int8Options | None = None
    openvino: Path | None = None
    openvino_int8: Path | None = None

    def __post_init__(self) -> None:
        if self.quantizes and self.int8_options is None:
            raise ValueError("an INT8 output needs its Int8Options")

    @classmethod
    def named(cls, files: Mapping[str, Path], export: ExportOptions, int8_options: Int8Options | None) -> RunOutputs:
        """The outputs at ``files``, by product name (``service.export.products``)."""
        unknown = sorted(set(files) - _FIELDS.keys())
        if unknown:
            raise ValueError(f"no such export: {', '.join(unknown)}")
        return cls(**{_FIELDS[name]: path for name, path in files.items()}, export=export, int8_options=int8_options)

    @property
    def quantizes(self) -> bool:
        """Whether the run has an INT8 phase: an INT8 file, or OpenVINO's files of one."""
        return self.int8 is not None or self.openvino_int8 is not None

    @property
    def any(self) -> bool:
        """Whether there is anything to make."""
        return self.onnx is not None or self.openvino is not None or self.quantizes


_FIELDS = {"onnx": "onnx", "onnx_int8": "int8", "openvino": "openvino", "openvino_int8": "openvino_int8"}
"""Each product's field (``service.export.products.PRODUCT_NAMES``)."""
assert set(_FIELDS) == set(PRODUCT_NAMES), "every exported file is a field of RunOutputs"


def make_outputs(
    result: Recalibration,
    request: RecalibrationRequest,
    outputs: RunOutputs,
    executor: Executor,
    control: RunControl,
    on_progress: ProgressCallback | None = None,
) -> None:
    """Write ``outputs`` for a finished recalibration, setting the report's ``onnx`` and
    ``int8`` sections. An INT8 file that fails its guard is not written: the report says
    why and ``result.int8_failed`` holds the error, for the surface to raise once the other
    outputs are kept (docs/int8.md). Any other failure raises (``ExportError``, ``RunError``).

    The exports run where the ranks run (docs/onnx.md, "Where the export runs"): every export
    the outputs need (the ONNX file, the FP32 model an INT8 file is quantized from, the
    stale model's) in one call to one rank, which builds the model from its source and
    weights with the new statistics and traces it once. Their retries and their cancel are
    ``control``'s (the run's control's ``later()``)."""
    progress = on_progress or (lambda done, total, phase: None)
    report, where = result.report, where_ranks_ran(result.report)
    passes = None
    if outputs.quantizes:
        passes = _int8_passes(result, request, executor, control, progress)
    control.check_cancel()
    progress(0, None, EXPORTING_PHASE)
    read = result.read_here
    asks = export_asks(outputs, passes is not None and _wants_stale(result, passes))  # INT8_BASE: the ONNX file when float32
    fixed, dynamic_batch = export_batch(result.model, outputs.export.dynamic_batch)
    samples = result.calibration_samples(max(VERIFY_SAMPLES, fixed))
    parts = share_asks(asks, request.workers)
    traced = result.traced.result() if result.traced is not None else None  # made while the ranks computed
    started = time.monotonic()
    calls = [(ExportWork(ModelBuild.of(result), samples, part, outputs.export, fixed, dynamic_batch, result.scope), traced)
             for part in parts]  # one trace for every call: put in the object store once
    ranks = executor.ranks()
    made = [export_models(*args) for args in calls] if ranks is None else ranks.map(
        export_models, calls, control=control, on_phase=lambda phase: progress(0, None, phase))
    wall = time.monotonic() - started
    exported = dict(zip([ask for part in parts for ask in part], [file for files in made for file in files], strict=True))
    onnx_file = ExportAsk(dtype=outputs.export.dtype)
    if outputs.onnx is not None:
        onnx = exported[onnx_file]
        atomic_write(outputs.onnx, lambda scratch: scratch.write_bytes(onnx.model))
        report.onnx = onnx.section
        add_to_timeline(report, "ONNX export and its checks", onnx.seconds, result.read_here - read, 0, where)
    if outputs.openvino is not None:
        _write_openvino(result, outputs, exported[INT8_BASE].model, outputs.openvino, int8=False)
    if outputs.quantizes:
        assert passes is not None
        others = [file for ask, file in exported.items() if outputs.onnx is None or ask != onnx_file]
        if others:  # the seconds they added to the job's, beyond the ONNX file's export (beside it on another rank)
            beyond = wall - exported[onnx_file].seconds if outputs.onnx is not None else wall
            add_to_timeline(report, "INT8 FP32 exports", max(0.0, beyond), 0, 0, where)
        stale = exported.get(STALE_BASE)
        control.check_cancel()
        progress(0, None, QUANTIZING_PHASE)
        _make_int8(result, outputs, passes, control, exported[INT8_BASE], stale.model if stale else None, progress)


INT8_BASE = ExportAsk(stale=False, dtype="float32", openvino=True)
"""The FP32 export an INT8 file is quantized from (the ONNX file itself, when that is float32)."""
STALE_BASE = ExportAsk(stale=True, dtype="float32", openvino=False)
"""The stale model's FP32 export, quantized alike to show what recalibrating bought; nobody deploys it."""


def export_asks(outputs: RunOutputs, stale: bool) -> tuple[ExportAsk, ...]:
    """The exports ``outputs`` need, each once: the ONNX file, the FP32 base of the INT8 file
    and of OpenVINO's files (the ONNX file when it is float32), and with ``stale`` the stale
    model's."""
    asks: list[ExportAsk] = []
    if outputs.onnx is not None:
        asks.append(ExportAsk(dtype=outputs.export.dtype))
    if outputs.quantizes or outputs.openvino is not None:
        bases = (INT8_BASE, *([STALE_BASE] if stale and outputs.quantizes else []))
        asks.extend(ask for ask in bases if ask not in asks)
    return tuple(asks)


def share_asks(asks: tuple[ExportAsk, ...], workers: int) -> list[tuple[ExportAsk, ...]]:
    """The exports in one call for one rank (one trace, reused for each: ``GraphReuse``), or,
    where the run has a rank for each, one call per export: the stale model's file is traced
    on the rank the ONNX file's export and checks would leave idle."""
    if workers < 2 or len(asks) < 2:
        return [asks]
    return [asks[i::workers] for i in range(min(workers, len(asks)))]


def _wants_stale(result: Recalibration, passes: OnnxPasses) -> bool:
    """Whether the INT8 phase quantizes the stale model alike: to score it on labelled
    evaluation data, or to measure the evaluation before and after (left to this phase)."""
    return passes.labelled or (result.evaluation_later and result.evaluation is not None)


def _int8_passes(
    result: Recalibration, request: RecalibrationRequest, executor: Executor, control: RunControl,
    progress: ProgressCallback,
) -> OnnxPasses:
    """The INT8 phase's passes on the run's ranks, each recorded in the report's timeline."""
    report, where = result.report, where_ranks_ran(result.report)

    def record(phase: str, done: GroupPass) -> None:
        reads = done.collectives[0] if done.collectives else 0  # each read of the samples ends in one collective
        add_to_timeline(report, phase, done.seconds, sum(done.samples) * reads, reads, where)

    # The ranges are gathered over the samples the statistics were computed on (docs/int8.md,
    # "How the ranges are gathered"): with max_samples "auto", the prefix of the order where
    # they converged.
    return passes_on(
        executor.ranks(), result.dataset, request.batch_size, int(report["samples"]), result.evaluation,
        control=control, on_phase=lambda phase: progress(0, None, phase), record=record,
    )


def _make_int8(
    result: Recalibration, outputs: RunOutputs, passes: OnnxPasses, control: RunControl, fp32: ExportedFile,
    stale: bytes | None, progress: ProgressCallback,
) -> None:
    """The INT8 phase: its passes and its work on the run's ranks, the file, its report
    section (and the evaluation before and after, when it was left to this phase)."""
    assert outputs.quantizes and outputs.int8_options is not None
    report, where = result.report, where_ranks_ran(result.report)
    evaluation = result.evaluation if result.evaluation_later else None

    def evaluated(metrics: EvalMetrics, seconds: float) -> None:
        assert evaluation is not None
        report.evaluation = EvaluationSection.of(DataSummary.of(evaluation.dataset.summary()), metrics,
                                                 seconds, ONNX_RUNTIME)

    def worked() -> None:  # the quantizer's own work, where the passes ran
        add_to_timeline(report, "INT8 quantizer and checks", passes.work_seconds, 0, 0, where)

    try:
        quantized = quantize_export(
            fp32.model, outputs.int8_options, passes, result.calibration_samples(VERIFY_SAMPLES), stale_fp32_model=stale,
            compare=evaluation.target if evaluation is not None else None, on_evaluation=evaluated,
            output=fp32.scores,
            on_phase=lambda phase: progress(0, None, phase),
        )
    except Int8GuardError as failed:  # the other outputs are still written (docs/int8.md)
        worked()
        result.report.int8, result.int8_failed = failed.section, failed
        return
    worked()
    control.check_cancel()
    if outputs.int8 is not None:
        quantized.write(outputs.int8)
    if outputs.openvino_int8 is not None:
        _write_openvino(result, outputs, quantized.model, outputs.openvino_int8, int8=True)
    section = quantized.section
    section.attempts = len(control.failures) + 1  # attempts of its passes on the ranks, as the report's top level counts
    section.retried_failures = control.failures
    result.report.int8 = section


def _write_openvino(result: Recalibration, outputs: RunOutputs, model: bytes, xml_path: Path, *, int8: bool) -> None:
    """OpenVINO's files of a checked ONNX ``model`` (``service.export.openvino_ir``), checked on
    the verified batches (one sample and the first ``VERIFY_SAMPLES``; only its static batch
    for a program exported with one), written as ``xml_path`` and its ``.bin``; their report
    section set."""
    from bnrecal.service.export.openvino_ir import make_openvino_ir

    fixed, dynamic = export_batch(result.model, outputs.export.dynamic_batch)
    data = result.calibration_samples(max(VERIFY_SAMPLES, fixed)).detach().cpu().to(torch.float32).numpy()
    batches = [data[:1], data] if dynamic and len(data) > 1 else [data[:fixed]]
    made = make_openvino_ir(model, batches, int8=int8)
    made.write(xml_path)
    if int8:
        result.report.openvino_int8 = made.section
    else:
        result.report.openvino = made.section
