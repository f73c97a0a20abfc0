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

import numpy as np
import torch

from bnrecal.workers.data import DatasetSpec
from bnrecal.errors import ExportError, Int8GuardError, Int8GuardUnreachableError
from bnrecal.workers.files import atomic_write
from bnrecal.workers.ranks.int8_ranges import RangeRequest

from bnrecal.service.export.int8.checks import LabelledBatches, accuracy, check_int8, latency_ms
from bnrecal.service.export.int8.guard import (
    REPORT_RULE,
    SELECTION_RULE,
    enforce_top1_drop,
    split_for_guard,
)
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
    evaluation: LabelledBatches | None = None,
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
        phase("evaluating INT8")
        model, report_part = _evaluate(section, fp32_model, model, prepared, data, options, reasons, evaluation)
        if stale_fp32_model is not None:
            phase("quantizing the stale model alike")
            stale = _quantize_alike(stale_fp32_model, options, gather, request, set(reasons))
            section["evaluation"]["stale_fp32"] = _top(accuracy(stale_fp32_model, report_part))
            section["evaluation"]["stale_int8"] = _top(accuracy(stale, report_part))
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


def _evaluate(section: dict[str, Any], fp32_model: bytes, model: bytes, prepared: PreparedModel, data: Any,
              options: Int8Options, reasons: dict[str, str], evaluation: LabelledBatches) -> tuple[bytes, LabelledBatches]:
    """Top-1/top-5 of the FP32 and INT8 models into ``section["evaluation"]``, guarded when
    ``max_top1_drop`` is set: the float ops chosen on the selection part of ``evaluation``,
    the accuracies reported on the other part. Returns the model to write and the part the
    accuracies are reported on; raises
    ``Int8GuardError`` (with ``section``) when the guard cannot hold."""
    guarding = options.max_top1_drop is not None
    if guarding and evaluation.samples < 2:
        raise ExportError("int8.max_top1_drop needs at least 2 labelled evaluation samples: one part chooses, "
                          "the other reports")
    selection, report_part = split_for_guard(evaluation) if guarding else (None, evaluation)
    fp32 = accuracy(fp32_model, report_part)
    scores: dict[str, Any] = {"samples": report_part.samples, "fp32": _top(fp32), "int8": _top(accuracy(model, report_part))}
    section["evaluation"] = scores
    if guarding:
        assert selection is not None
        selection_fp32 = accuracy(fp32_model, selection)["top1"]
        selection_int8 = accuracy(model, selection)["top1"]
        guard: dict[str, Any] = {
            "max_top1_drop": options.max_top1_drop,
            "selection": {"samples": selection.samples, "which": SELECTION_RULE, "fp32_top1": selection_fp32,
                          "int8_top1_before": selection_int8},
            "report": {"samples": report_part.samples, "which": REPORT_RULE},
        }
        section["guard"] = guard
        try:
            guarded = enforce_top1_drop(
                prepared, data, options, list(reasons), model, selection_fp32, selection_int8,
                lambda candidate: accuracy(candidate, selection)["top1"],
            )
        except Int8GuardUnreachableError as failed:
            guard.update({"held": False, "kept_float": failed.kept, "reason": str(failed)})
            scores["top1_drop_points"] = 100.0 * (scores["fp32"]["top1"] - scores["int8"]["top1"])
            section.update({"written": False, "failure": str(failed)})
            raise Int8GuardError(str(failed), section) from failed
        guard["selection"]["int8_top1_after"] = guarded.top1
        guard.update({"held": True, "kept_float": guarded.kept, "models_measured": guarded.measured})
        if guarded.kept:
            model = guarded.model
            scores["int8"] = _top(accuracy(model, report_part))
            for kept in guarded.kept:
                reasons[kept["name"]] = (
                    f"kept float by int8.max_top1_drop (recovers {kept['top1_gain_alone_points']:+.2f} top-1 points alone)"
                )
    scores["top1_drop_points"] = 100.0 * (scores["fp32"]["top1"] - scores["int8"]["top1"])
    if guarding:
        section["guard"]["report_drop_points"] = scores["top1_drop_points"]
        section["guard"]["held_on_report"] = scores["top1_drop_points"] <= float(options.max_top1_drop)  # type: ignore[arg-type]
    return model, report_part


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


def labelled_batches(dataset: DatasetSpec, labels: np.ndarray, batch_size: int) -> LabelledBatches:
    """The evaluation data read once, to measure several models on."""
    batches, targets = [], []
    with dataset.open() as data:
        for start in range(0, dataset.num_samples, batch_size):
            stop = min(start + batch_size, dataset.num_samples)
            batches.append(data.load(start, stop).numpy().astype(np.float32, copy=False))
            targets.append(np.asarray(labels[start:stop], dtype=np.int64))
    return LabelledBatches(batches, targets)


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
    fp32_model: bytes | None = None,
    export_options: ExportOptions | None = None,
    cancel: threading.Event | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The INT8 export of a recalibration, written to ``path``, its ranges by ``gather`` (the
    run's executor's: the statistics' ranks, over the samples the statistics were computed
    on); returns the report's ``int8`` section. ``fp32_model`` is the run's folded FP32
    export when it wrote one (float32), else one is made with ``export_options``."""
    from bnrecal.service.run.exporting import export_recalibrated

    export = export_options or ExportOptions()
    kwargs = {"opset": export.opset, "dynamic_batch": export.dynamic_batch, "input_shape": export.input_shape}
    if fp32_model is None:
        fp32_model = fp32_bytes_for(lambda scratch: export_recalibrated(result, scratch, **kwargs))
    evaluation = stale = None
    plan = result.evaluation
    if plan is not None and plan.labels is not None and plan.target.labelled:
        evaluation = labelled_batches(plan.dataset, plan.labels, request.batch_size)
        stale_model = result.stale_model()
        stale = fp32_bytes_for(lambda scratch: export_recalibrated(result, scratch, model=stale_model, **kwargs))
    quantized = quantize_export(
        fp32_model, options, gather, result.calibration_samples(VERIFY_SAMPLES),
        evaluation=evaluation, stale_fp32_model=stale, on_phase=on_phase,
    )
    check_cancel(cancel)
    quantized.write(path)
    return quantized.section
