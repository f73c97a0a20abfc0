"""Fold the BatchNormalization nodes left in an exported ONNX graph (an ``onnx_ir`` model).

The graph is the real dataflow, so the legality checks of docs/onnx.md, "What is folded", are exact
here: the BN input must come from a Conv, ConvTranspose, Gemm or 2-D MatMul whose output
feeds only the BN and whose weights feed only that node; otherwise the BN output must
feed only a Conv (any group) without zero padding. Folded weights are computed in
float64 (working copies, written back once in the initializer's dtype). A BN that cannot
be folded stays, and the result says why, in terms a user can act on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from bnrecal.service.export.folding.arithmetic import WeightLayout, batchnorm_affine, fold_into_conv_input, fold_into_producer

_PRODUCERS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Add")


@dataclass
class OnnxFoldResult:
    """What the graph pass did: folded BN names, BNs left with their reasons, and the
    names of the weight initializers it rewrote (for fp16 overflow messages)."""

    folded: list[str] = field(default_factory=list)
    unfolded: list[tuple[str, str]] = field(default_factory=list)
    rewritten: dict[str, str] = field(default_factory=dict)


def batchnorm_display_name(node: ir.Node) -> str:
    """The BN's PyTorch module name where the exporter kept it (``<name>.running_mean``)."""
    mean = node.inputs[3] if len(node.inputs) > 3 else None
    if mean is not None and mean.name and mean.name.endswith(".running_mean"):
        return mean.name.removesuffix(".running_mean")
    return node.name or "BatchNormalization"


def _attr(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _sole_use(value: ir.Value | None, node: ir.Node) -> bool:
    if value is None or value.is_graph_output():
        return False
    uses = value.uses()
    return len(uses) == 1 and next(iter(uses)).node is node


def _constant(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.is_graph_input() or value.const_value is None:
        return None
    return value.const_value.numpy()


class _Weights:
    """Float64 working copies of the initializers being rewritten."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.work: dict[int, tuple[ir.Value, np.ndarray, np.dtype]] = {}
        self.taken = set(graph.initializers) | {v.name for n in graph for v in n.outputs if v.name}
        self.taken |= {v.name for v in graph.inputs if v.name}

    def get(self, value: ir.Value) -> np.ndarray:
        if id(value) not in self.work:
            array = value.const_value.numpy()
            self.work[id(value)] = (value, array.astype(np.float64), array.dtype)
        return self.work[id(value)][1]

    def set(self, value: ir.Value, array: np.ndarray) -> None:
        _, _, dtype = self.work[id(value)]
        self.work[id(value)] = (value, array, dtype)

    def new(self, base_name: str, array: np.ndarray, dtype: np.dtype) -> ir.Value:
        name, index = base_name, 1
        while name in self.taken:
            name, index = f"{base_name}_{index}", index + 1
        self.taken.add(name)
        value = ir.Value(name=name, const_value=ir.tensor(array.astype(dtype), name=name))
        value.shape = ir.Shape(array.shape)
        value.dtype = ir.DataType.from_numpy(np.dtype(dtype))
        self.graph.register_initializer(value)
        self.work[id(value)] = (value, array, np.dtype(dtype))
        return value

    def write_back(self) -> None:
        for value, array, dtype in self.work.values():
            value.const_value = ir.tensor(array.astype(dtype), name=value.name)
            value.shape = ir.Shape(array.shape)


class _BatchNormFolder:
    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.weights = _Weights(graph)
        self.result = OnnxFoldResult()

    # ---- checks -------------------------------------------------------------------------
    def _weight_problem(self, node: ir.Node, index: int, role: str) -> str | None:
        value = node.inputs[index] if len(node.inputs) > index else None
        if value is None:
            return None if role == "bias" else f"{node.op_type} has no weight"
        if not value.is_initializer() or _constant(value) is None:
            return f"{node.op_type} {role} '{value.name}' is not a constant initializer"
        if not _sole_use(value, node):
            return f"{node.op_type} {role} '{value.name}' is shared with another node"
        return None

    def _linear_parts(self, bn: ir.Node) -> tuple[dict, str | None]:
        """Find the producer of the BN input and check it; returns (parts, problem)."""
        source = bn.inputs[0]
        producer = source.producer()
        if producer is None:
            return {}, "its input is a graph input"
        if producer.domain != "" or producer.op_type not in _PRODUCERS:
            return {}, f"producer {producer.op_type} is not Conv, ConvTranspose, Gemm or MatMul"
        if not _sole_use(source, bn):
            return {}, f"the output of {producer.op_type} '{producer.name}' is also used elsewhere"
        if producer.op_type in ("Conv", "ConvTranspose", "Gemm"):
            problem = self._weight_problem(producer, 1, "weight") or self._weight_problem(producer, 2, "bias")
            return {"node": producer}, problem
        add = None
        if producer.op_type == "Add":
            add = producer
            matmuls = [v for v in add.inputs if v is not None and v.producer() is not None
                       and v.producer().op_type == "MatMul"]
            if len(matmuls) != 1:
                return {}, "producer Add is not a MatMul plus a bias"
            bias_value = add.inputs[1] if add.inputs[0] is matmuls[0] else add.inputs[0]
            if not _sole_use(matmuls[0], add):
                return {}, "the MatMul output is also used elsewhere"
            problem = self._weight_problem(add, list(add.inputs).index(bias_value), "bias")
            if problem:
                return {}, problem
            producer = matmuls[0].producer()
        rank = producer.inputs[0].shape.rank() if producer.inputs[0].shape is not None else None
        if rank != 2:
            return {}, (
                f"MatMul input has rank {rank if rank is not None else 'unknown'}: BatchNormalization "
                "normalises axis 1, which is not the MatMul's feature axis"
            )
        weight = _constant(producer.inputs[1])
        if weight is None or weight.ndim != 2:
            return {}, "MatMul weight is not a constant 2-D initializer"
        problem = self._weight_problem(producer, 1, "weight")
        return {"node": producer, "add": add}, problem

    def _consumer_problem(self, bn: ir.Node) -> str | None:
        out = bn.outputs[0]
        if out.is_graph_output():
            return "its output is a graph output"
        uses = list(out.uses())
        if len(uses) != 1:
            return f"its output feeds {len(uses)} nodes"
        conv, index = uses[0].node, uses[0].idx
        if conv.domain != "" or conv.op_type != "Conv" or index != 0:
            return f"consumer {conv.op_type} is not a Conv"
        pads = _attr(conv, "pads", ())
        auto_pad = _attr(conv, "auto_pad", "NOTSET")
        if auto_pad in ("SAME_UPPER", "SAME_LOWER") or any(p != 0 for p in pads):
            return f"consumer Conv pads with zeros (pads={list(pads) or auto_pad})"
        return self._weight_problem(conv, 1, "weight") or self._weight_problem(conv, 2, "bias")

    # ---- folds --------------------------------------------------------------------------
    def _bias_of(self, node: ir.Node, index: int, channels: int, like: ir.Value) -> ir.Value:
        if len(node.inputs) > index and node.inputs[index] is not None:
            return node.inputs[index]
        value = self.weights.new(f"{like.name}.folded_bias", np.zeros(channels), like.const_value.numpy().dtype)
        if len(node.inputs) <= index:
            node.resize_inputs(index + 1)
        node.replace_input_with(index, value)
        return value

    def _bypass(self, bn: ir.Node, replacement: ir.Value) -> None:
        out = bn.outputs[0]
        name, was_output = out.name, out.is_graph_output()
        replacement.shape, replacement.type = out.shape, out.type
        out.replace_all_uses_with(replacement, replace_graph_outputs=True)
        self.graph.remove(bn, safe=True)
        if was_output:
            replacement.name = name

    def _fold_into_producer(self, bn: ir.Node, parts: dict, scale: np.ndarray, shift: np.ndarray) -> None:
        node = parts["node"]
        weight_value = node.inputs[1]
        weight = self.weights.get(weight_value)
        if node.op_type in ("Conv", "ConvTranspose"):
            layout: WeightLayout = "conv" if node.op_type == "Conv" else "conv_transpose"
            groups = int(_attr(node, "group", 1))
            old_bias = node.inputs[2] if len(node.inputs) > 2 else None
            bias = None if old_bias is None else self.weights.get(old_bias)
            w, b = fold_into_producer(weight, bias, scale, shift, layout, groups)  # validates before any change
            bias_value = self._bias_of(node, 2, scale.shape[0], weight_value)
            self.weights.set(weight_value, w)
            self.weights.set(bias_value, b)
            self._bypass(bn, node.outputs[0])
        elif node.op_type == "Gemm":
            layout = "out_in" if int(_attr(node, "transB", 0)) else "in_out"
            alpha, beta = float(_attr(node, "alpha", 1.0)), float(_attr(node, "beta", 1.0))
            bias = None
            if len(node.inputs) > 2 and node.inputs[2] is not None:
                bias = np.broadcast_to(beta * self.weights.get(node.inputs[2]), (1, scale.shape[0])).reshape(-1)
            w, b = fold_into_producer(alpha * weight, bias, scale, shift, layout)
            self.weights.set(weight_value, w)
            new_bias = self.weights.new(f"{weight_value.name}.folded_bias", b, self.weights.work[id(weight_value)][2])
            node.resize_inputs(3)
            node.replace_input_with(2, new_bias)
            node.attributes["alpha"] = ir.AttrFloat32("alpha", 1.0)
            node.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
            self._bypass(bn, node.outputs[0])
        else:  # MatMul (+ Add) on 2-D input becomes one Gemm
            add = parts["add"]
            bias = None
            if add is not None:
                bias_input = next(v for v in add.inputs if v is not node.outputs[0])
                bias = np.broadcast_to(self.weights.get(bias_input), (1, scale.shape[0])).reshape(-1)
            w, b = fold_into_producer(weight, bias, scale, shift, "in_out")
            self.weights.set(weight_value, w)
            new_bias = self.weights.new(f"{weight_value.name}.folded_bias", b, self.weights.work[id(weight_value)][2])
            gemm = ir.Node("", "Gemm", [node.inputs[0], weight_value, new_bias], name=f"{node.name}_gemm")
            self.graph.insert_before(bn, gemm)
            self._bypass(bn, gemm.outputs[0])
            if add is not None:
                self.graph.remove(add, safe=True)
            self.graph.remove(node, safe=True)
        self.result.rewritten[weight_value.name] = batchnorm_display_name(bn)

    def _fold_into_consumer(self, bn: ir.Node, scale: np.ndarray, shift: np.ndarray) -> None:
        conv = next(iter(bn.outputs[0].uses())).node
        weight_value = conv.inputs[1]
        old_bias = conv.inputs[2] if len(conv.inputs) > 2 else None
        bias = None if old_bias is None else self.weights.get(old_bias)
        groups = int(_attr(conv, "group", 1))
        w, b = fold_into_conv_input(self.weights.get(weight_value), bias, scale, shift, groups)
        bias_value = self._bias_of(conv, 2, w.shape[0], weight_value)
        self.weights.set(weight_value, w)
        self.weights.set(bias_value, b)
        conv.replace_input_with(0, bn.inputs[0])
        self.graph.remove(bn, safe=True)
        self.result.rewritten[weight_value.name] = batchnorm_display_name(bn)

    def fold(self, bn: ir.Node) -> None:
        name = batchnorm_display_name(bn)
        params = [_constant(v) if v is not None else None for v in bn.inputs[1:5]]
        if len(bn.inputs) < 5 or any(p is None for p in params):
            self.result.unfolded.append((name, "its scale, bias, mean or variance is not a constant"))
            return
        if int(_attr(bn, "training_mode", 0)) or any(o.uses() or o.is_graph_output() for o in bn.outputs[1:]):
            self.result.unfolded.append((name, "it runs in training mode (uses batch statistics)"))
            return
        try:
            scale, shift = batchnorm_affine(*params, float(_attr(bn, "epsilon", 1e-5)))
        except ValueError as exc:
            self.result.unfolded.append((name, str(exc)))
            return
        parts, producer_problem = self._linear_parts(bn)
        if producer_problem is None:
            try:
                self._fold_into_producer(bn, parts, scale, shift)
                self.result.folded.append(name)
                return
            except ValueError as exc:
                producer_problem = str(exc)
        consumer_problem = self._consumer_problem(bn)
        if consumer_problem is None:
            try:
                self._fold_into_consumer(bn, scale, shift)
                self.result.folded.append(name)
                return
            except ValueError as exc:
                consumer_problem = str(exc)
        self.result.unfolded.append(
            (name, f"not into its producer ({producer_problem}) nor its consumer ({consumer_problem})")
        )


def fold_batchnorm_nodes(model: ir.Model) -> OnnxFoldResult:
    """Fold every legal BatchNormalization node of ``model``'s main graph, in place.

    Run it after constant folding (weights must be initializers) and before initializer
    deduplication (which would make distinct weights look shared). BatchNormalization
    nodes inside control-flow subgraphs are reported, not folded.
    """
    folder = _BatchNormFolder(model.graph)
    for node in list(model.graph):
        if node.op_type == "BatchNormalization" and node.domain == "":
            folder.fold(node)
    folder.weights.write_back()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "BatchNormalization" and node.graph is not model.graph:
            folder.result.unfolded.append((batchnorm_display_name(node), "it is inside a control-flow subgraph"))
    return folder.result
