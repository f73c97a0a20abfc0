"""The folded FP32 model prepared as onnxruntime prepares it, and the QDQ graph written by
onnxruntime's own quantizer from ranges gathered elsewhere (the ranks).

The steps are those of ``onnxruntime.quantization.quantize_static`` in QDQ format, minus
its single-process calibration: ``quant_pre_process`` (shape inference and optimization),
the model reloaded with shape inference, the tensors its calibrators would calibrate
(``CalibraterBase.select_tensors_to_calibrate``), then ``QDQQuantizer`` given a
``TensorsData`` and saved the way ``quantize_static`` saves it. Given the same ranges, the
bytes are those ``quantize_static`` writes (tested).
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bnrecal.workers.engine.ranges import TensorRanges
from bnrecal.errors import ExportError, first_line

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.int8.targets import placement
from bnrecal.service.export.report_sections import FloatOp, GraphSummary, RangesAsMinmax

QDQ = "QuantizeLinear", "DequantizeLinear"


@dataclass(frozen=True)
class PreparedModel:
    """The pre-processed FP32 model (serialized) and the tensors to calibrate, sorted."""

    model: bytes
    tensors: tuple[str, ...]
    node_names: tuple[str, ...]
    op_types: dict[str, str]
    float_tensors: frozenset[str] = frozenset()


def quantizable_op_types() -> list[str]:
    """The op types ``quantize_static`` quantizes by default (its registries), sorted."""
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return sorted(set(QLinearOpsRegistry) | set(QDQRegistry))


@contextlib.contextmanager
def _quiet():
    """onnxruntime's tooling prints and logs warnings meant for notebooks."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)


def prepare(fp32_model: bytes) -> PreparedModel:
    """onnxruntime's pre-processing of the folded export, and the tensors to calibrate."""
    from onnxruntime.quantization import QuantType, quant_pre_process
    from onnxruntime.quantization.calibrate import CalibraterBase
    from onnxruntime.quantization.quant_utils import load_model_with_shape_infer, update_opset_version

    with tempfile.TemporaryDirectory(prefix="bnrecal-int8-") as tmp, _quiet():
        source, processed = Path(tmp) / "fp32.onnx", Path(tmp) / "fp32-pre.onnx"
        source.write_bytes(fp32_model)
        try:
            quant_pre_process(str(source), str(processed))
        except Exception as exc:  # noqa: BLE001 - onnxruntime's tooling raises anything
            raise ExportError(f"onnxruntime's quantization pre-processing fails: {first_line(exc)}") from exc
        model = update_opset_version(load_model_with_shape_infer(processed), QuantType.QInt8, QuantType.QUInt8)
        tensors, _ = CalibraterBase(processed, op_types_to_calibrate=quantizable_op_types()).select_tensors_to_calibrate(
            model
        )
    import onnx

    graph = model.graph
    floats = {
        vi.name for vi in (*graph.value_info, *graph.input, *graph.output)
        if vi.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    } - {init.name for init in graph.initializer}
    return PreparedModel(
        model.SerializeToString(),
        tuple(sorted(tensors)),
        tuple(node.name for node in graph.node),
        {node.name: node.op_type for node in graph.node},
        frozenset(floats),
    )


def tensors_data(ranges: TensorRanges, histograms: np.ndarray | None, edges: Sequence[np.ndarray] | None,
                 options: Int8Options) -> Any:
    """The ranges as onnxruntime's quantizer takes them (``TensorsData``): min and max for
    ``minmax``; for ``percentile`` and ``entropy`` the thresholds onnxruntime's own
    ``HistogramCollector`` computes from the combined histograms."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, HistogramCollector, TensorsData

    unseen = [name for i, name in enumerate(ranges.names) if not np.isfinite(ranges.low[i])]
    if unseen:
        raise ExportError(f"INT8: tensor {unseen[0]!r} took no finite value on the calibration data")
    if options.method == "minmax":
        return TensorsData(CalibrationMethod.MinMax, ranges.pairs())
    assert histograms is not None and edges is not None
    collector = HistogramCollector(
        method=options.method, symmetric=options.absolute, num_bins=options.histogram_bins(),
        num_quantized_bins=options.quantized_bins, percentile=options.percentile, scenario="same",
    )
    for i, name in enumerate(ranges.names):
        low, high = np.float32(ranges.low[i]), np.float32(ranges.high[i])
        entry: tuple[Any, ...] = (histograms[i], edges[i], low, high)
        if not options.absolute:
            entry = (*entry, np.float32(max(abs(low), abs(high))))
        collector.histogram_dict[name] = entry
    with _quiet():
        result = collector.compute_collection_result()
    method = CalibrationMethod.Percentile if options.method == "percentile" else CalibrationMethod.Entropy
    return TensorsData(method, result)


def resolve_keep_float(prepared: PreparedModel, keep_float: Sequence[str]) -> dict[str, str]:
    """Node name -> reason for every node the user keeps in float (by name or op type)."""
    kept: dict[str, str] = {}
    for entry in keep_float:
        if entry in prepared.op_types:
            kept[entry] = "kept float as asked (int8.keep_float)"
            continue
        matched = [name for name, op in prepared.op_types.items() if op == entry]
        if not matched:
            raise ExportError(
                f"int8.keep_float: {entry!r} names no node or op type of the exported graph "
                f"(op types: {', '.join(sorted(set(prepared.op_types.values())))})"
            )
        for name in matched:
            kept[name] = f"kept float as asked (int8.keep_float: {entry})"
    return kept


def activation_quant_type(options: Int8Options) -> Any:
    """onnxruntime's ``QuantType`` of the activations."""
    from onnxruntime.quantization import QuantType

    return {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8, "uint16": QuantType.QUInt16,
            "int16": QuantType.QInt16}[options.activation()]


def write_qdq(prepared: PreparedModel, data: Any, options: Int8Options, exclude: Sequence[str]) -> bytes:
    """The QDQ model onnxruntime's ``QDQQuantizer`` writes from ``data``, ``exclude``d nodes in
    float, Q/DQ placed for ``options.target`` (``targets.placement``)."""
    import onnx
    from onnxruntime.quantization import QDQQuantizer, QuantType

    model = onnx.load_from_string(prepared.model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    where = placement(options, quantizable_op_types(), opset)
    with tempfile.TemporaryDirectory(prefix="bnrecal-int8-") as tmp, _quiet():
        try:
            quantizer = QDQQuantizer(
                model, options.per_channel, options.weights_reduced(), QuantType.QInt8, activation_quant_type(options),
                data, [], list(exclude), where.op_types, where.extra_options.onnxruntime(),
            )
            quantizer.quantize_model()
            out = Path(tmp) / "int8.onnx"
            drop_unused_domains(quantizer.model.model)
            quantizer.model.save_model_to_file(str(out))
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"onnxruntime's QDQ quantizer fails: {first_line(exc)}") from exc
        return out.read_bytes()


def drop_unused_domains(model: Any) -> None:
    """Remove the opset imports no node uses (onnxruntime's pre-processing declares eight,
    ``ai.onnx.training``, ``org.pytorch.aten``..., that a QDQ file never needs). The default
    domain always stays."""
    used = {node.domain for node in model.graph.node} | {"", "ai.onnx"}
    keep = [opset for opset in model.opset_import if opset.domain in used]
    if len(keep) != len(model.opset_import):
        del model.opset_import[:]
        model.opset_import.extend(keep)


def graph_summary(int8_model: bytes, prepared: PreparedModel, reasons: dict[str, str],
                  options: Int8Options) -> GraphSummary:
    """Ops quantized (by op type) and ops left in float, each with its reason."""
    import onnx

    graph = onnx.load_from_string(int8_model).graph
    produced_by = {out: node for node in graph.node for out in node.output}
    present = {node.name: node for node in graph.node if node.op_type not in QDQ}
    quantizable = set(quantizable_op_types())
    placed = set(placement(options, sorted(quantizable), 0).op_types)
    quantized: dict[str, int] = {}
    left: list[FloatOp] = []
    merged = shapes = 0
    for name in prepared.node_names:
        op_type = prepared.op_types[name]
        node = present.get(name)
        if node is None:
            merged += 1  # a Relu or Clip onnxruntime merged into its input's quantization range
            continue
        if op_type in placed and any(
            produced_by.get(i) is not None and produced_by[i].op_type == "DequantizeLinear" for i in node.input
        ):
            quantized[op_type] = quantized.get(op_type, 0) + 1
            continue
        if prepared.float_tensors and not any(i in prepared.float_tensors for i in node.input):
            shapes += 1  # shape arithmetic (Shape, Concat of int64 sizes...): no activation to quantize
            continue
        if name in reasons:
            reason = reasons[name]
        elif op_type not in quantizable:
            reason = f"onnxruntime's QDQ quantizer has no INT8 form of {op_type}"
        elif op_type not in placed:
            reason = ("not in int8.op_types" if options.op_types is not None
                      else f"target {options.target} places no Q/DQ on {op_type} (the runtime runs it as it chooses)")
        else:
            reason = "onnxruntime's QDQ quantizer left it float (its inputs are not quantized)"
        left.append(FloatOp(name=name, op_type=op_type, reason=reason))
    return GraphSummary(
        ops_quantized=dict(sorted(quantized.items())),
        ops_float=left,
        ops_merged=merged,
        ops_on_shapes=shapes,
        quantize_linear_nodes=sum(1 for node in graph.node if node.op_type == "QuantizeLinear"),
        dequantize_linear_nodes=sum(1 for node in graph.node if node.op_type == "DequantizeLinear"),
    )


def quantized_node_names(int8_model: bytes, options: Int8Options) -> list[str]:
    """The names of the ops that run in INT8 (of a type the target quantizes, fed by a
    DequantizeLinear), in graph order."""
    import onnx

    graph = onnx.load_from_string(int8_model).graph
    produced_by = {out: node.op_type for node in graph.node for out in node.output}
    quantizable = set(placement(options, quantizable_op_types(), 0).op_types)
    return [
        node.name for node in graph.node
        if node.op_type in quantizable and any(produced_by.get(i) == "DequantizeLinear" for i in node.input)
    ]


def ranges_as_minmax(data: Any, ranges: TensorRanges) -> RangesAsMinmax:
    """How many tensors a histogram method gave exactly the min/max range (float32), and a
    note when it is all of them: the file is then the ``minmax`` file (docs/int8.md)."""
    minmax = dict(ranges.pairs())
    same = 0
    for name, (low, high) in minmax.items():
        got = data[name].range_value
        if _scalar(got[0]) == _scalar(low) and _scalar(got[1]) == _scalar(high):
            same += 1
    every = bool(minmax) and same == len(minmax)
    return RangesAsMinmax(tensors=same, of=len(minmax),
                          note="every range is the min/max range: this file is the minmax file" if every else None)


def check_op_types(options: Int8Options) -> None:
    """``int8.op_types`` entries are op types onnxruntime's QDQ quantizer quantizes; else an
    ``ExportError`` naming the entry, before any range pass."""
    if options.op_types is None:
        return
    known = set(quantizable_op_types())
    unknown = [op for op in options.op_types if op not in known]
    if unknown:
        raise ExportError(
            f"int8.op_types: {unknown[0]!r} is not an op type onnxruntime's QDQ quantizer quantizes "
            f"(it quantizes: {', '.join(sorted(known))})"
        )


def _scalar(value: Any) -> float:
    return float(np.float32(np.asarray(value).ravel()[0]))
