"""The INT8 export of a run (docs/int8.md): ranges gathered over the calibration samples with
the calibration's sharding, the QDQ graph written by onnxruntime's tooling
(``service.export.int8``), verified, measured on the evaluation data beside the FP32 model
and the stale model quantized alike, and guarded.

``quantize_export`` is the one path, in the fewest passes over the samples: the FP32 models'
ranges in one pass over the calibration samples (which also scores them, and measures the
evaluation before and after, where the evaluation samples are those samples), then one pass
scoring the INT8 models. Where the passes run is an ``OnnxPasses`` (``service.run.outputs.onnx_passes``):
a run's executor's (its Ray ranks, or this process for a one-worker run), or this process
as the world of one (``bnrecal export``, the Python API), which gives the same file. A run's
INT8 file is one of its later phases (``service.run.outputs.later_phases``).
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bnrecal.errors import ExportError, Int8GuardError, Int8GuardUnreachableError
from bnrecal.workers.engine.evaluation import EvalMetrics, EvalTarget
from bnrecal.workers.files import atomic_write
from bnrecal.workers.ranks.ort.rank_pass import Comparison, ModelResult, OnnxPassResult, PassModel, RangeRequest
from bnrecal.workers.ranks.plan import GroupPass

from bnrecal.service.export.int8.checks import check_int8, latency_ms
from bnrecal.service.export.int8.guard import REPORT_RULE, SELECTION_RULE, enforce_top1_drop
from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.int8.quantizer import (
    PreparedModel,
    check_op_types,
    graph_summary,
    prepare,
    ranges_as_minmax,
    resolve_keep_float,
    tensors_data,
    write_qdq,
)
from bnrecal.service.export.report_sections import (
    GraphSummary,
    GuardReportPart,
    GuardSelection,
    Int8Checks,
    Int8Evaluation,
    Int8Guard,
    Int8Section,
    Latency,
    TopScores,
)
from bnrecal.service.export.verification import VERIFY_SAMPLES
from bnrecal.service.run.outputs.onnx_passes import InProcessPasses, OnnxPasses
from bnrecal.service.settings import Settings

MODEL, STALE = 0, 1
"""Where the model to quantize and the stale model stand in a pass of both."""


@dataclass
class Quantized:
    """An INT8 model ready to write, and its report section."""

    model: bytes
    section: Int8Section

    def write(self, path: str | Path) -> None:
        """Write the file atomically."""
        atomic_write(Path(path), lambda scratch: scratch.write_bytes(self.model))


@dataclass
class _Float32Pass:
    """The FP32 models' pass: the ranges of the model (and of the stale model), and their
    scores on every part of the evaluation data where measured."""

    gathered: GroupPass
    measured: OnnxPassResult | None

    def ranges(self, index: int) -> ModelResult:
        return self.gathered.result.models[index]


def range_request(prepared: PreparedModel, options: Int8Options) -> RangeRequest:
    """What a range pass gathers of ``prepared`` for ``options``."""
    bins = options.histogram_bins() if options.method != "minmax" else 0
    return RangeRequest(prepared.tensors, options.method, bins, options.absolute)


def quantize_export(
    fp32_model: bytes,
    options: Int8Options,
    passes: OnnxPasses,
    verify: torch.Tensor,
    *,
    stale_fp32_model: bytes | None = None,
    compare: EvalTarget | None = None,
    on_evaluation: Callable[[EvalMetrics, float], None] | None = None,
    output: int = 0,
    on_phase: Callable[[str], None] | None = None,
) -> Quantized:
    """Quantize the folded FP32 export: ranges by ``passes`` over the calibration samples,
    QDQ by onnxruntime's quantizer placed for ``options.target``, checked on the ``verify``
    samples, measured and guarded on the labelled evaluation data when ``passes`` has some
    (with the stale model's export quantized alike when given). With ``compare`` (and the
    stale export) the same FP32 pass measures the evaluation before and after, handed to
    ``on_evaluation`` with the pass's seconds. ``output`` is the graph output holding the class scores. Raises
    ``ExportError`` on a failed check, ``Int8GuardError`` (carrying the report's section)
    when the guard cannot hold."""
    phase = on_phase or (lambda _: None)
    if options.max_top1_drop is not None and not passes.labelled:
        raise ExportError(
            "int8.max_top1_drop needs labelled evaluation data (eval data with labels) to measure top-1 on"
        )
    check_op_types(options)
    with_stale = stale_fp32_model is not None and (passes.labelled or compare is not None)
    phase("preparing the INT8 export")  # onnxruntime's pre-processing, on the ranks as the passes run
    prepared, *stale_prepared = passes.map(prepare, [(fp32_model,), *([(stale_fp32_model,)] if with_stale else [])])
    stale = stale_prepared[0] if stale_prepared else None
    reasons = resolve_keep_float(prepared, options.keep_float)  # before the range passes: a typo costs nothing
    fp32 = _float32_pass(fp32_model, prepared, stale_fp32_model, stale, options, passes, compare, output, phase)
    if fp32.measured is not None and fp32.measured.evaluation is not None and on_evaluation is not None:
        on_evaluation(fp32.measured.evaluation, fp32.measured.seconds)
    found = fp32.ranges(MODEL)
    phase("writing and verifying INT8")
    alike = None
    if passes.labelled and stale is not None:  # the stale model quantized alike, beside the model, on another rank
        alike = _QuantizerAlike(stale, fp32.ranges(STALE), options, passes, phase)
        (data, model), stale_file = passes.map(quantize, [(prepared, found, options, list(reasons)),
                                                          alike.first(set(reasons))])
        alike.keep(set(reasons), stale_file)
    else:
        data, model = passes.call(quantize, prepared, found, options, list(reasons))
    section = _section(options, prepared, fp32.gathered)
    if options.method != "minmax":
        section.ranges_as_minmax = ranges_as_minmax(data, found.ranges)
    if passes.labelled:
        assert fp32.measured is not None
        phase("evaluating INT8")
        model = _evaluate(section, fp32.measured, model, prepared, data, options, reasons, passes, alike, output)
    samples = verify.detach().cpu().to(torch.float32).numpy()[:VERIFY_SAMPLES]
    latency = file_latency(passes, fp32_model, model, samples[:1])  # before the checks, which use every core
    checks = passes.call(check_file, model, fp32_model, samples, prepared, reasons, options)
    section = section.model_copy(update={
        **vars(checks.checked), "verified_batches": [1, len(samples)], **vars(checks.summary),
        "bytes": len(model), "fp32_bytes": len(fp32_model), "latency_ms": latency, "written": True,
    })
    if section.saturates and options.max_top1_drop is not None:
        failure = (f"int8.max_top1_drop: the INT8 file saturates in {' and '.join(section.saturates)} on this CPU "
                   f"without VNNI ({section.cpu.describe()}), so its accuracy here is not the file's: write 7-bit "
                   "weights (int8.reduce_range true, the default for CPU targets) or build on a CPU with VNNI")
        section.written, section.failure = False, failure
        raise Int8GuardError(failure, section)
    return Quantized(model, section)


def quantize(prepared: PreparedModel, found: ModelResult, options: Int8Options,
             exclude: Sequence[str]) -> tuple[Any, bytes]:
    """The ranges ``found`` as onnxruntime's quantizer takes them (the entropy or percentile
    search for the histogram methods) and the QDQ file it writes, ``exclude``d nodes in
    float: the INT8 phase's heaviest computing, run where its passes run."""
    data = tensors_data(found.ranges, found.histograms, found.edges, options)
    return data, write_qdq(prepared, data, options, exclude)


@dataclass(frozen=True)
class FileChecks:
    """An INT8 file's checks against its FP32 export (both runtimes) and what its graph holds."""

    checked: Int8Checks
    summary: GraphSummary


def check_file(model: bytes, fp32_model: bytes, samples: np.ndarray, prepared: PreparedModel,
               reasons: dict[str, str], options: Int8Options) -> FileChecks:
    """The INT8 file ``model`` checked on the first and all of ``samples`` against the FP32
    export, and its graph summed up: run where the passes run, like the quantizer."""
    return FileChecks(check_int8(model, fp32_model, [samples[:1], samples]),
                      graph_summary(model, prepared, reasons, options))


@dataclass(frozen=True)
class TimedFile:
    """One file's median latency (milliseconds) and the machine it was measured on."""

    ms: float
    machine: str


def time_file(model: bytes, sample: np.ndarray) -> TimedFile:
    """``latency_ms`` of ``model`` on ``sample`` and the machine it ran on: run where the passes run."""
    return TimedFile(latency_ms(model, sample), socket.gethostname())


def time_files(models: Sequence[bytes], sample: np.ndarray) -> list[TimedFile]:
    """``time_file`` of each of ``models``, one after the other in this process."""
    return [time_file(model, sample) for model in models]


def file_latency(passes: OnnxPasses, fp32_model: bytes, model: bytes, sample: np.ndarray) -> Latency:
    """Both files' latency on one sample, as a deployed model answers one request (docs/int8.md,
    "Checks and the report's `int8` section"): side by side on two ranks where the run has
    them, each on one intra-op thread (a single-threaded neighbour leaves a median as it is
    alone, a multi-threaded one doubles it: so nothing else runs meanwhile); one after the
    other on one rank where those two ranks are on different machines, whose CPUs may differ."""
    fp32, int8 = passes.map(time_file, [(fp32_model, sample), (model, sample)])
    if fp32.machine != int8.machine:
        fp32, int8 = passes.call(time_files, [fp32_model, model], sample)
    return Latency(batch=1, fp32=fp32.ms, int8=int8.ms)


def _float32_pass(
    fp32_model: bytes, prepared: PreparedModel, stale_fp32_model: bytes | None, stale: PreparedModel | None,
    options: Int8Options, passes: OnnxPasses, compare: EvalTarget | None, output: int, phase: Callable[[str], None],
) -> _Float32Pass:
    """The FP32 models' ranges in one pass over the calibration samples; their scores on the
    evaluation data (and the evaluation before and after) in the same pass where those are
    the calibration samples, else in one pass over the evaluation data."""
    comparison = Comparison(STALE, MODEL, compare) if compare is not None and stale is not None else None
    measure = passes.labelled or comparison is not None
    together = measure and passes.shares_samples
    models = [PassModel(prepared.model, range_request(prepared, options))]
    if stale is not None and (passes.labelled or together):  # its ranges only where its INT8 model is scored
        models.append(PassModel(stale.model, range_request(stale, options) if passes.labelled else None))
    phase("collecting INT8 ranges" + (" and evaluating" if together else ""))
    gathered = passes.over_calibration(models, evaluate=together, compare=comparison, output=output)
    if together or not measure:
        return _Float32Pass(gathered, gathered.result if together else None)
    phase("evaluating the FP32 exports")
    exported = [PassModel(fp32_model)] + ([PassModel(stale_fp32_model)] if stale_fp32_model and stale else [])
    return _Float32Pass(gathered, passes.over_evaluation(exported, compare=comparison, output=output).result)


class _QuantizerAlike:
    """Writes the stale model's INT8 file alike: its own ranges, the same options and float
    ops, where the passes run; its ranges made onnxruntime's once (``first``: beside the
    model's own file), each set of float ops written once."""

    def __init__(self, stale: PreparedModel, found: ModelResult, options: Int8Options, passes: OnnxPasses,
                 phase: Callable[[str], None]) -> None:
        self.stale, self.found, self.options, self.passes, self.phase = stale, found, options, passes, phase
        self.data: Any = None
        self.written: dict[frozenset[str], bytes] = {}

    def first(self, float_ops: set[str]) -> tuple[Any, ...]:
        """``quantize``'s arguments for the stale model with ``float_ops`` kept float."""
        return self.stale, self.found, self.options, self._excluded(float_ops)

    def keep(self, float_ops: set[str], quantized: tuple[Any, bytes]) -> None:
        """What ``quantize`` made of ``first(float_ops)``: the ranges as onnxruntime takes them, and the file."""
        self.data, self.written[frozenset(float_ops)] = quantized

    def __call__(self, float_ops: set[str]) -> bytes:
        key = frozenset(float_ops)
        if key not in self.written:
            self.phase("quantizing the stale model alike")
            self.written[key] = self.passes.call(write_qdq, self.stale, self.data, self.options,
                                                 self._excluded(float_ops))
        return self.written[key]

    def _excluded(self, float_ops: set[str]) -> list[str]:
        return sorted(float_ops & set(self.stale.node_names))


def _section(options: Int8Options, prepared: PreparedModel, gathered: GroupPass) -> Int8Section:
    """The report's ``int8`` section as far as the ranges go."""
    histogram = options.method != "minmax"
    return Int8Section(
        target=options.target,
        method=options.method,
        weight_type="int8",
        weights=("symmetric, per output channel" if options.per_channel else "symmetric, per tensor")
        + (", 7-bit (reduce_range)" if options.weights_reduced() else ", 8-bit"),
        activation_type=options.activation(),
        symmetric_activations=options.activations_symmetric(),
        per_channel=options.per_channel,
        reduce_range=options.weights_reduced(),
        weights_why=options.weights_why(),
        format="QDQ",
        writer=_writer(),
        tensors_calibrated=len(prepared.tensors),
        samples=sum(gathered.samples),
        world_size=len(gathered.samples),
        collectives=list(gathered.collectives),
        range_seconds=gathered.seconds,
        op_types=list(options.op_types) if options.op_types is not None else None,
        bins=options.histogram_bins() if histogram else None,
        percentile=options.percentile if options.method == "percentile" else None,
        quantized_bins=options.quantized_bins if histogram and options.method != "percentile" else None,
    )


def _evaluate(
    section: Int8Section, fp32: OnnxPassResult, model: bytes, prepared: PreparedModel, data: Any,
    options: Int8Options, reasons: dict[str, str], passes: OnnxPasses,
    stale_alike: Callable[[set[str]], bytes] | None, output: int,
) -> bytes:
    """Top-1/top-5 of the FP32 and INT8 models (and the stale model's, FP32 and quantized
    alike, when given) into ``section.evaluation``, guarded when ``max_top1_drop`` is set:
    the float ops chosen on the selection part (even positions), the accuracies reported on
    the other part (odd positions). ``fp32`` holds the FP32 models' scores on every part; the
    INT8 models are scored together in one pass, the guard's candidates many to a pass.
    Returns the model to write; raises ``Int8GuardError`` (with ``section``) when the guard
    cannot hold."""
    guarding = options.max_top1_drop is not None
    if guarding and passes.evaluation_samples < 2:
        raise ExportError("int8.max_top1_drop needs at least 2 labelled evaluation samples: one part chooses, "
                          "the other reports")
    report_part = "odd" if guarding else "all"

    def score(models: Sequence[bytes], part: str = "all") -> OnnxPassResult:
        return passes.over_evaluation([PassModel(m) for m in models], part=part, output=output).result

    def selection_top1(candidates: Sequence[bytes]) -> list[float]:
        scored = score(candidates, "even")
        return [scored.scores(i, "even")["top1"] for i in range(len(candidates))]

    stale_int8 = [stale_alike(set(reasons))] if stale_alike is not None else []
    reported = score([model, *stale_int8])  # every part: the guard's selection, and the report part
    if guarding:
        selection_fp32, selection_int8 = fp32.scores(MODEL, "even")["top1"], reported.scores(MODEL, "even")["top1"]
        guard = Int8Guard(
            max_top1_drop=options.max_top1_drop,
            selection=GuardSelection(samples=fp32.scores(MODEL, "even")["samples"], which=SELECTION_RULE,
                                     fp32_top1=selection_fp32, int8_top1_before=selection_int8),
            report=GuardReportPart(which=REPORT_RULE),
        )
        section.guard = guard
        try:
            guarded = enforce_top1_drop(
                prepared, options, list(reasons), model, selection_fp32, selection_int8, selection_top1,
                lambda excluded: passes.map(write_qdq, [(prepared, data, options, list(e)) for e in excluded]),
            )
        except Int8GuardUnreachableError as failed:
            fp32_top, int8_top = fp32.scores(MODEL, report_part), reported.scores(MODEL, report_part)
            guard.report.samples = fp32_top["samples"]
            guard.held, guard.kept_float, guard.reason = False, list(failed.kept), str(failed)  # type: ignore[arg-type]
            section.evaluation = Int8Evaluation(samples=fp32_top["samples"], fp32=_top(fp32_top), int8=_top(int8_top),
                                                top1_drop_points=100.0 * (fp32_top["top1"] - int8_top["top1"]))
            section.written, section.failure = False, str(failed)
            raise Int8GuardError(str(failed), section) from failed
        guard.selection.int8_top1_after = guarded.top1
        guard.held, guard.kept_float, guard.models_measured = True, guarded.kept, guarded.measured
        if guarded.kept:
            model = guarded.model
            for kept in guarded.kept:
                reasons[kept.name] = (
                    f"kept float by int8.max_top1_drop (recovers {kept.top1_gain_alone_points:+.2f} top-1 points alone)"
                )
            stale_int8 = [stale_alike(set(reasons))] if stale_alike is not None else []
            reported = score([model, *stale_int8], report_part)  # the model kept, the stale one alike
    fp32_top, int8_top = _top(fp32.scores(MODEL, report_part)), _top(reported.scores(MODEL, report_part))
    scores = Int8Evaluation(
        samples=fp32.scores(MODEL, report_part)["samples"], fp32=fp32_top, int8=int8_top,
        stale_fp32=_top(fp32.scores(STALE, report_part)) if stale_int8 else None,
        stale_int8=_top(reported.scores(STALE, report_part)) if stale_int8 else None,
        top1_drop_points=100.0 * (fp32_top.top1 - int8_top.top1),
    )
    section.evaluation = scores
    if guarding:
        guard.report.samples = scores.samples
        guard.report_drop_points = scores.top1_drop_points
        guard.held_on_report = scores.top1_drop_points <= float(options.max_top1_drop)  # type: ignore[arg-type]
    return model


def _top(scores: dict[str, float]) -> TopScores:
    return TopScores(top1=scores["top1"], top5=scores["top5"])


def _writer() -> str:
    import onnxruntime

    return f"onnxruntime {onnxruntime.__version__} QDQQuantizer"


def fp32_bytes_for(export: Callable[[Path], Any]) -> bytes:
    """Run ``export`` into a scratch file and return its bytes (an FP32 export to quantize
    that the user did not ask to keep)."""
    with tempfile.TemporaryDirectory(prefix="bnrecal-int8-") as tmp:
        path = Path(tmp) / "fp32.onnx"
        export(path)
        return path.read_bytes()


def quantize_file(
    fp32_path: str | Path,
    data: str | Path,
    path: str | Path,
    options: Int8Options,
    settings: Settings,
    *,
    transform: dict[str, Any] | None = None,
    batch_size: int = 32,
) -> Int8Section:
    """Quantize a folded FP32 export as it is (``bnrecal export --onnx-int8``), its ranges
    gathered in this process over every sample of ``data``; returns the ``int8`` section."""
    from bnrecal.workers.data import ReadOptions, describe_dataset

    access = settings.data_access()  # s3:// data through the configured endpoint, as every other surface reads it
    dataset = describe_dataset(data, ReadOptions(transform=transform), access)
    with dataset.open() as opened:
        verify = opened.load(0, min(VERIFY_SAMPLES, dataset.num_samples))
    quantized = quantize_export(Path(fp32_path).read_bytes(), options, InProcessPasses(dataset, batch_size), verify)
    quantized.write(path)
    return quantized.section
