"""Cast a folded float32 ONNX graph to float16, consistently.

Folding happens first, in float64, on the float32 graph; this pass then casts every
float32 initializer, the graph's inputs and outputs, ``Cast``/``ConstantOfShape``
targets and dtype attributes to float16, so that every op sees one float type (the
checker's strict type inference verifies it). Inputs that an op's schema fixes to
``tensor(float)`` (e.g. ``Resize`` scales) keep float32. A weight that would overflow
float16 is refused, naming the layer, instead of shipping infinities.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from bnrecal.errors import ExportError

FLOAT16_MAX = float(np.finfo(np.float16).max)


def _fixed_float_input(node: ir.Node, index: int, opset: int) -> bool:
    """True where the op's schema types this input as float32 regardless of the rest."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return False
    formal = schema.inputs
    if not formal:
        return False
    param = formal[min(index, len(formal) - 1)]
    return param.type_str == "tensor(float)"


def _check_range(graph: ir.Graph, rewritten: dict[str, str]) -> None:
    for value in graph.initializers.values():
        if value.const_value is None or value.const_value.dtype != ir.DataType.FLOAT:
            continue
        array = value.const_value.numpy()
        peak = float(np.max(np.abs(array))) if array.size else 0.0
        if peak > FLOAT16_MAX or not np.isfinite(peak):
            origin = rewritten.get(value.name)
            where = f" (folded from BatchNorm '{origin}': check its running_var and eps)" if origin else ""
            raise ExportError(
                f"weight '{value.name}' reaches {peak:.4g}, beyond float16's {FLOAT16_MAX:.0f}{where}; "
                "export with --onnx-dtype float32"
            )


def _cast_attributes(node: ir.Node) -> None:
    float32, float16 = ir.DataType.FLOAT, ir.DataType.FLOAT16
    for name in ("to", "dtype"):
        attr = node.attributes.get(name)
        if attr is not None and attr.type == ir.AttributeType.INT and attr.value == float32.value:
            node.attributes[name] = ir.AttrInt64(name, float16.value)
    value_attr = node.attributes.get("value")
    if node.op_type == "ConstantOfShape" and value_attr is not None and value_attr.value.dtype == float32:
        node.attributes["value"] = ir.AttrTensor("value", ir.tensor(value_attr.value.numpy().astype(np.float16)))


def convert_to_float16(model: ir.Model, opset: int, rewritten: dict[str, str]) -> None:
    """Cast ``model`` (main graph, folded, constants as initializers) to float16 in place.

    ``rewritten`` maps folded weight names to the BN folded into them, for the error
    message when a folded weight overflows float16.
    """
    graph = model.graph
    _check_range(graph, rewritten)
    float32, float16 = ir.DataType.FLOAT, ir.DataType.FLOAT16
    for value in list(graph.initializers.values()):
        if value.const_value is None or value.const_value.dtype != float32:
            continue
        uses = list(value.uses())
        fixed = [u for u in uses if _fixed_float_input(u.node, u.idx, opset)]
        half = ir.tensor(value.const_value.numpy().astype(np.float16), name=value.name)
        if not fixed:
            value.const_value, value.dtype = half, float16
            continue
        if len(fixed) < len(uses):  # some uses want float16: give them their own copy
            copy = ir.Value(name=f"{value.name}.float16", const_value=half)
            copy.shape, copy.dtype = value.shape, float16
            graph.register_initializer(copy)
            for use in uses:
                if use not in fixed:
                    use.node.replace_input_with(use.idx, copy)
    for value in (*graph.inputs, *graph.outputs):
        if value.dtype == float32:
            value.dtype = float16
    for node in list(graph):
        _cast_attributes(node)
        for index, value in enumerate(node.inputs):
            if value is None or value.is_initializer() or not _fixed_float_input(node, index, opset):
                continue
            cast = ir.Node(
                "", "Cast", [value], [ir.AttrInt64("to", float32.value)], name=f"{node.name}_to_float32_{index}"
            )
            graph.insert_before(node, cast)
            node.replace_input_with(index, cast.outputs[0])
    graph_outputs = {id(v) for v in graph.outputs}
    for node in graph:
        for value in node.outputs:
            if id(value) not in graph_outputs:
                value.type, value.shape = None, None
