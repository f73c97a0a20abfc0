"""Graph passes around the BN fold: constant folding before, clean-up and checks after.

The dynamo exporter without its optimizer builds some weights at run time (a missing
conv bias as ``Expand(CastLike(0), Shape(weight))``, the scale of an ``affine=False`` BN,
transposed Linear weights in the TorchScript exporter); onnxruntime cannot fuse what it
does not see as a constant, and our fold cannot read it. Everything computable from
constants is folded into plain initializers here, with no size limit.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxscript.optimizer

from bnrecal.errors import ExportError, first_line

_UNLIMITED = 2**62
MAX_FILE_BYTES = 2**31 - 1


def fold_constants(model: ir.Model) -> None:
    """Fold every deterministic node whose inputs are all constants; lift constants to
    initializers; drop all-zero conv biases."""
    onnxscript.optimizer.inline(model)
    onnxscript.optimizer.fold_constants(
        model,
        onnx_shape_inference=True,
        input_size_limit=_UNLIMITED,
        output_size_limit=_UNLIMITED,
        should_fold=lambda node: True,
    )
    ir.passes.Sequential(
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
    )(model)
    drop_zero_conv_biases(model)
    common_passes.RemoveUnusedNodesPass()(model)


def drop_zero_conv_biases(model: ir.Model) -> int:
    """Remove all-zero constant biases of Conv/ConvTranspose nodes; returns how many.

    The dynamo exporter without its optimizer builds a zero bias for every bias-free
    conv, and for ``conv3d`` builds it with the wrong shape (C, 2), which onnxruntime
    rejects; a zero bias adds nothing, so it goes (the BN fold adds a real one).
    """
    dropped = 0
    for node in model.graph:
        if node.domain != "" or node.op_type not in ("Conv", "ConvTranspose") or len(node.inputs) < 3:
            continue
        bias = node.inputs[2]
        if bias is None or bias.is_graph_input() or bias.const_value is None:
            continue
        if not bias.const_value.numpy().any():
            node.resize_inputs(2)
            dropped += 1
    return dropped


def globalize_whole_input_pools(model: ir.Model) -> int:
    """Rewrite each ``AveragePool``/``MaxPool`` whose one window covers its whole (static)
    spatial input into ``GlobalAveragePool``/``GlobalMaxPool``; returns how many.

    Hugging Face's EfficientNet pools with ``AvgPool2d(hidden_dim, ceil_mode=True)``: a
    kernel (1280) larger than the feature map. PyTorch and onnxruntime clip the window to
    the input (a global pool), but OpenVINO refuses a kernel larger than its input, so the
    file would not run there. With no padding and one output position per axis the two ops
    compute the same values (the divisor is the input's area either way).
    """
    rewritten = 0
    for node in list(model.graph):
        if node.domain != "" or node.op_type not in ("AveragePool", "MaxPool"):
            continue
        if len(node.outputs) != 1:  # a MaxPool's indices have no global counterpart
            continue
        spatial = _static_spatial_dims(node.inputs[0])
        attrs = {name: attr.value for name, attr in node.attributes.items()}
        kernel = list(attrs.get("kernel_shape", []))
        if spatial is None or len(kernel) != len(spatial):
            continue
        strides = list(attrs.get("strides", [1] * len(kernel)))
        no_padding = not any(attrs.get("pads", [])) and attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID")
        undilated = all(d == 1 for d in attrs.get("dilations", [1] * len(kernel)))
        ceil = bool(attrs.get("ceil_mode", 0))
        if not (no_padding and undilated and all(_one_window(d, k, s, ceil) for d, k, s in zip(spatial, kernel, strides))):
            continue
        pooled = ir.node("Global" + node.op_type, inputs=[node.inputs[0]], name=f"{node.name}_global")
        ir.convenience.replace_nodes_and_values(
            model.graph, node, [node], [pooled], list(node.outputs), list(pooled.outputs)
        )
        rewritten += 1
    return rewritten


def _static_spatial_dims(value: ir.Value | None) -> list[int] | None:
    """The input's spatial sizes (after batch and channels) when all are known integers."""
    if value is None or value.shape is None or len(value.shape) < 3:
        return None
    dims = list(value.shape)[2:]
    return dims if all(isinstance(d, int) for d in dims) else None


def _one_window(size: int, kernel: int, stride: int, ceil: bool) -> bool:
    """Whether a pool over ``size`` with ``kernel`` and ``stride`` (no padding) has exactly
    one output position, whose window starts at 0 and covers the whole input."""
    if kernel < size or stride < 1:
        return False
    steps = -((kernel - size) // stride) if ceil else (size - kernel) // stride  # ceil/floor of (size-kernel)/stride
    return steps == 0


def finalize(model: ir.Model) -> None:
    """Drop what the fold left unused, merge identical initializers, give every value a
    unique name, and strip the exporter's per-node metadata (stack traces, local paths)."""
    ir.passes.Sequential(
        common_passes.RemoveUnusedNodesPass(),
        common_passes.RemoveUnusedFunctionsPass(),
        common_passes.RemoveUnusedOpsetsPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.ClearMetadataAndDocStringPass(),
        common_passes.NameFixPass(),
        common_passes.TopologicalSortPass(),
    )(model)
    model.graph.metadata_props.clear()
    for value in (*model.graph.inputs, *model.graph.outputs):
        value.metadata_props.clear()


def runtime_constant_nodes(model: ir.Model) -> list[str]:
    """Nodes of the main graph that compute a value from constants alone, at run time."""
    constant: set[int] = {id(v) for v in model.graph.initializers.values()}
    found = []
    for node in model.graph:
        inputs = [v for v in node.inputs if v is not None]
        has_subgraph = any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()
        )
        if all(id(v) in constant for v in inputs) and not has_subgraph:
            found.append(f"{node.op_type} '{node.name}'")
            constant.update(id(v) for v in node.outputs)
    return found


def batchnorm_count(proto: onnx.ModelProto) -> int:
    """BatchNormalization nodes in the graph, subgraphs included."""

    def count(graph: onnx.GraphProto) -> int:
        total = 0
        for node in graph.node:
            total += node.op_type == "BatchNormalization"
            for attr in node.attribute:
                total += sum(count(g) for g in ([attr.g] if attr.HasField("g") else [])) + sum(
                    count(g) for g in attr.graphs
                )
        return total

    return count(proto.graph)


def check_size(model: ir.Model) -> None:
    """Raise ExportError where the weights alone exceed what one .onnx file can hold (2 GB)."""
    size = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if size > MAX_FILE_BYTES:
        raise ExportError(f"ONNX weights take {size} bytes, over the 2 GB limit of a single .onnx file")


def check_final_model(model: ir.Model, proto: onnx.ModelProto, opset: int) -> None:
    """Raise ExportError unless the model is one valid, self-contained file as promised."""
    outputs = {id(v) for v in model.graph.outputs}
    if any(id(v) in outputs for node in model.graph if node.op_type == "Constant" for v in node.outputs):
        raise ExportError("an ONNX output does not depend on the input (the exporter traced it to a constant)")
    leftovers = runtime_constant_nodes(model)
    if leftovers:
        raise ExportError(f"ONNX graph computes constants at run time ({', '.join(leftovers[:3])}); cannot export")
    names = [init.name for init in proto.graph.initializer]
    if len(names) != len(set(names)):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise ExportError(f"ONNX graph has two initializers named '{duplicate}'")
    external = [init.name for init in proto.graph.initializer if init.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise ExportError(f"ONNX initializer '{external[0]}' is stored as external data, not in the file")
    got = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if got != opset:
        raise ExportError(f"exporter produced opset {got}, not the requested opset {opset}; choose another --opset")
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ExportError(f"ONNX model fails onnx.checker (full check): {first_line(exc)}") from exc
