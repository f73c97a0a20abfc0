"""The INT8 export of a run (docs/int8.md): ranges gathered by the ranks over the
calibration samples with the calibration's sharding, the QDQ graph written by
onnxruntime's tooling (``service.export.int8``), verified, measured on the evaluation
data beside the FP32 model and the stale model quantized alike, and guarded.

``quantize_export`` is the one path; where the ranges come from is a ``RangeGatherer``
(``service.run.ranges``): a run's executor's (its Ray ranks, or this process for a
one-worker run), or this process as the world of one (``bnrecal export``, the Python
API), which gives the same file. A run's INT8 file is one of its later phases
(``service.run.outputs``).
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bnrecal.errors import ExportError, Int8GuardError, Int8GuardUnreachableError
from bnrecal.workers.files import atomic_write
from bnrecal.workers.ranks.int8_ranges import RangeRequest

from bnrecal.service.export.int8.checks import HeldScorer, LabelledBatches, Scorer, check_int8, latency_ms
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
from bnrecal.service.run.core import check_cancel
from bnrecal.service.run.options import ExportOptions
from bnrecal.service.run.ranges import RangeGatherer, in_process
from bnrecal.service.run.recalibration import Recalibration, RecalibrationRequest
from bnrecal.service.settings import Settings

VERIFY_SAMPLES = 8


@dataclass
class Quantized:
    """An INT8 model ready to write, and its report section."""

    model: bytes
    section: dict[str, Any]

    def write(self, path: str | Path) -> None:
        """Write the file atomically."""
        atomic_write(Path(path), lambda scratch: scratch.write_bytes(self.model))


def quantize_export(
    fp32_model: bytes,
    options: Int8Options,
    gather: RangeGatherer,
    verify: torch.Tensor,
    *,
    evaluation: Scorer | LabelledBatches | None = None,
    stale_fp32_model: bytes | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> Quantized:
    """Quantize the folded FP32 export: ranges by ``gather``, QDQ by onnxruntime's quantizer
    placed for ``options.target``, checked on the ``verify`` samples, measured and guarded on
    ``evaluation`` (with the stale model's export quantized alike when given). Raises
    ``ExportError`` on a failed check, ``Int8GuardError`` (carrying the report's section) when
    the guard cannot hold."""
    phase = on_phase or (lambda _: None)
    if options.max_top1_drop is not None and evaluation is None:
        raise ExportError(
            "int8.max_top1_drop needs labelled evaluation data (eval data with labels) to measure top-1 on"
        )
    prepared = prepare(fp32_model)
    reasons = resolve_keep_float(prepared, options.keep_float)  # before the range passes: a typo costs nothing
    check_op_types(options)
    phase("collecting INT8 ranges")
    request = RangeRequest(
        prepared.tensors, options.method, options.histogram_bins() if options.method != "minmax" else 0,
        options.absolute,
    )
    gathered = gather(prepared.model, request)
    data = tensors_data(gathered.result.ranges, gathered.result.histograms, gathered.result.edges, options)
    phase("writing and verifying INT8")
    model = write_qdq(prepared, data, options, list(reasons))
    section: dict[str, Any] = {
        "target": options.target,
        "method": options.method,
        "weight_type": "int8",
        "weights": ("symmetric, per output channel" if options.per_channel else "symmetric, per tensor")
        + (", 7-bit (reduce_range)" if options.reduce_range else ""),
        "activation_type": options.activation(),
        "symmetric_activations": options.activations_symmetric(),
        "per_channel": options.per_channel,
        "reduce_range": options.reduce_range,
        "format": "QDQ",
        "writer": _writer(),
        "tensors_calibrated": len(prepared.tensors),
        "samples": sum(gathered.samples),
        "world_size": len(gathered.samples),
        "collectives": gathered.collectives,
        "range_seconds": gathered.seconds,
    }
    if options.op_types is not None:
        section["op_types"] = list(options.op_types)
    if options.method != "minmax":
        section["bins"] = options.histogram_bins()
        if options.method == "percentile":
            section["percentile"] = options.percentile
        else:
            section["quantized_bins"] = options.quantized_bins
        section["ranges_as_minmax"] = ranges_as_minmax(data, gathered.result.ranges)
    if evaluation is not None:
        score = HeldScorer(evaluation) if isinstance(evaluation, LabelledBatches) else evaluation

        def stale_alike(float_ops: set[str]) -> bytes:
            assert stale_fp32_model is not None
            phase("quantizing the stale model alike")
            return _quantize_alike(stale_fp32_model, options, gather, request, float_ops)

        phase("evaluating INT8")
        model = _evaluate(
            section, fp32_model, model, prepared, data, options, reasons, score,
            stale_fp32_model, stale_alike if stale_fp32_model is not None else None,
        )
    samples = verify.detach().cpu().to(torch.float32).numpy()[:VERIFY_SAMPLES]
    section.update(check_int8(model, fp32_model, [samples[:1], samples]))
    section["verified_batches"] = [1, len(samples)]
    section.update(graph_summary(model, prepared, reasons, options))
    section["bytes"] = len(model)
    section["fp32_bytes"] = len(fp32_model)
    one = samples[:1]  # batch 1, as a deployed model answers one request
    section["latency_ms"] = {"batch": 1, "fp32": latency_ms(fp32_model, one), "int8": latency_ms(model, one)}
    section["written"] = True
    return Quantized(model, section)


def _evaluate(
    section: dict[str, Any], fp32_model: bytes, model: bytes, prepared: PreparedModel, data: Any,
    options: Int8Options, reasons: dict[str, str], score: Scorer, stale_fp32_model: bytes | None,
    stale_alike: Callable[[set[str]], bytes] | None,
) -> bytes:
    """Top-1/top-5 of the FP32 and INT8 models (and the stale model's, FP32 and quantized
    alike, when given) into ``section["evaluation"]``, guarded when ``max_top1_drop`` is set:
    the float ops chosen on the selection part (even positions), the accuracies reported on
    the other part (odd positions). Every model reported is scored in one pass (``score``);
    the guard's sensitivity measurements score many candidates per pass. Returns the model
    to write; raises ``Int8GuardError`` (with ``section``) when the guard cannot hold."""
    guarding = options.max_top1_drop is not None
    if guarding and score.samples < 2:
        raise ExportError("int8.max_top1_drop needs at least 2 labelled evaluation samples: one part chooses, "
                          "the other reports")
    report_part = "odd" if guarding else "all"
    guard: dict[str, Any] = {}
    if guarding:
        selection = score([fp32_model, model], "even")
        selection_fp32, selection_int8 = selection[0]["top1"], selection[1]["top1"]
        guard.update({
            "max_top1_drop": options.max_top1_drop,
            "selection": {"samples": selection[0]["samples"], "which": SELECTION_RULE, "fp32_top1": selection_fp32,
                          "int8_top1_before": selection_int8},
            "report": {"which": REPORT_RULE},
        })
        section["guard"] = guard
        try:
            guarded = enforce_top1_drop(
                prepared, data, options, list(reasons), model, selection_fp32, selection_int8,
                lambda candidates: [scores["top1"] for scores in score(candidates, "even")],
            )
        except Int8GuardUnreachableError as failed:
            fp32, int8 = score([fp32_model, model], report_part)
            guard["report"]["samples"] = fp32["samples"]
            guard.update({"held": False, "kept_float": failed.kept, "reason": str(failed)})
            section["evaluation"] = {"samples": fp32["samples"], "fp32": _top(fp32), "int8": _top(int8),
                                     "top1_drop_points": 100.0 * (fp32["top1"] - int8["top1"])}
            section.update({"written": False, "failure": str(failed)})
            raise Int8GuardError(str(failed), section) from failed
        guard["selection"]["int8_top1_after"] = guarded.top1
        guard.update({"held": True, "kept_float": guarded.kept, "models_measured": guarded.measured})
        if guarded.kept:
            model = guarded.model
            for kept in guarded.kept:
                reasons[kept["name"]] = (
                    f"kept float by int8.max_top1_drop (recovers {kept['top1_gain_alone_points']:+.2f} top-1 points alone)"
                )
    models = [fp32_model, model]
    if stale_fp32_model is not None and stale_alike is not None:
        models += [stale_fp32_model, stale_alike(set(reasons))]
    reported = score(models, report_part)
    scores: dict[str, Any] = {"samples": reported[0]["samples"], "fp32": _top(reported[0]), "int8": _top(reported[1])}
    if len(reported) == 4:
        scores["stale_fp32"], scores["stale_int8"] = _top(reported[2]), _top(reported[3])
    scores["top1_drop_points"] = 100.0 * (scores["fp32"]["top1"] - scores["int8"]["top1"])
    section["evaluation"] = scores
    if guarding:
        guard["report"]["samples"] = scores["samples"]
        guard["report_drop_points"] = scores["top1_drop_points"]
        guard["held_on_report"] = scores["top1_drop_points"] <= float(options.max_top1_drop)  # type: ignore[arg-type]
    return model


def _quantize_alike(
    fp32_model: bytes, options: Int8Options, gather: RangeGatherer, like: RangeRequest, float_ops: set[str]
) -> bytes:
    """Another export (the stale model's) quantized with the same options and float ops."""
    prepared: PreparedModel = prepare(fp32_model)
    request = RangeRequest(prepared.tensors, like.method, like.bins, like.absolute)
    gathered = gather(prepared.model, request)
    data = tensors_data(gathered.result.ranges, gathered.result.histograms, gathered.result.edges, options)
    return write_qdq(prepared, data, options, sorted(float_ops & set(prepared.node_names)))


def _top(scores: dict[str, float]) -> dict[str, float]:
    return {"top1": scores["top1"], "top5": scores["top5"]}


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
) -> dict[str, Any]:
    """Quantize a folded FP32 export as it is (``bnrecal export --onnx-int8``), its ranges
    gathered in this process over every sample of ``data``; returns the ``int8`` section."""
    from bnrecal.workers.data import describe_dataset

    dataset = describe_dataset(data, transform=transform, **settings.unpack_options())
    with dataset.open() as opened:
        verify = opened.load(0, min(VERIFY_SAMPLES, dataset.num_samples))
    quantized = quantize_export(Path(fp32_path).read_bytes(), options, in_process(dataset, batch_size), verify)
    quantized.write(path)
    return quantized.section


def quantize_recalibrated(
    result: Recalibration,
    request: RecalibrationRequest,
    path: str | Path,
    options: Int8Options,
    gather: RangeGatherer,
    *,
    score: Scorer | None = None,
    fp32_model: bytes | None = None,
    export_options: ExportOptions | None = None,
    cancel: threading.Event | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The INT8 export of a recalibration, written to ``path``, its ranges by ``gather`` and
    its models scored by ``score`` when there is labelled evaluation data (both the run's
    executor's: the statistics' ranks, over the samples the statistics were computed on,
    and over the evaluation's shards); returns the report's ``int8`` section.
    ``fp32_model`` is the run's folded FP32 export when it wrote one (float32), else one is
    made with ``export_options``."""
    from bnrecal.service.run.exporting import export_recalibrated

    export = export_options or ExportOptions()
    kwargs = {"opset": export.opset, "dynamic_batch": export.dynamic_batch, "input_shape": export.input_shape}
    if fp32_model is None:
        fp32_model = fp32_bytes_for(lambda scratch: export_recalibrated(result, scratch, **kwargs))
    stale = None
    if score is not None:
        stale_model = result.stale_model()
        stale = fp32_bytes_for(lambda scratch: export_recalibrated(result, scratch, model=stale_model, **kwargs))
    quantized = quantize_export(
        fp32_model, options, gather, result.calibration_samples(VERIFY_SAMPLES),
        evaluation=score, stale_fp32_model=stale, on_phase=on_phase,
    )
    check_cancel(cancel)
    quantized.write(path)
    return quantized.section
