"""Fold BatchNorm layers into their neighbours in PyTorch, on the model's real dataflow.

The dataflow comes from a ``torch.fx`` trace where the model traces (standard conv,
linear and BatchNorm modules kept as leaves); where it does not, only the children of
plain ``nn.Sequential`` containers are paired, and a forward pass with hooks checks that
each module runs exactly once. A fold is made only when it is legal (docs/onnx.md, "What
is folded"): the producer's output feeds the BN alone, no weight is shared with another
call site, and a BN -> Conv fold needs a conv that does not pad with zeros. Everything
else is left to the ONNX graph pass, which sees the exported graph.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from bnrecal.service.export.folding.arithmetic import WeightLayout, batchnorm_affine, fold_into_conv_input, fold_into_producer
from bnrecal.workers.tracing import holds_tracing

logger = logging.getLogger(__name__)

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_STANDARD_FORWARDS = {
    *(cls.forward for cls in (*_CONVS, *_CONV_TRANSPOSES, nn.Linear, *_BATCHNORMS)),
}
ModuleCheck = Callable[[str, nn.Module], str | None]
_STANDARD_CONV_FORWARDS = {None, *(getattr(cls, "_conv_forward", None) for cls in (*_CONVS, *_CONV_TRANSPOSES))}


@dataclass
class TorchFoldResult:
    """What the PyTorch pass did: folded BN module names, and why the others were not."""

    method: str
    folded: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    rewritten: dict[str, str] = field(default_factory=dict)  # weight name -> BN folded into it


def _is_standard(module: nn.Module, kinds: tuple[type, ...]) -> bool:
    """True for an instance of ``kinds`` whose forward is torch's own (not overridden)."""
    cls = type(module)
    if not isinstance(module, kinds) or cls.forward not in _STANDARD_FORWARDS:
        return False
    return getattr(cls, "_conv_forward", None) in _STANDARD_CONV_FORWARDS


def _is_producer(module: nn.Module) -> bool:
    return _is_standard(module, (*_CONVS, *_CONV_TRANSPOSES, nn.Linear))


def _is_batchnorm(module: nn.Module) -> bool:
    return _is_standard(module, _BATCHNORMS)


def _layout(module: nn.Module) -> WeightLayout:
    if isinstance(module, _CONV_TRANSPOSES):
        return "conv_transpose"
    if isinstance(module, nn.Linear):
        return "out_in"
    return "conv"


def _batchnorm_problem(bn: nn.Module) -> str | None:
    if bn.training:
        return "BatchNorm is in training mode"
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return "BatchNorm has no running statistics (it normalises with batch statistics)"
    return None


def _pads_with_zeros(conv: nn.Module) -> bool:
    if conv.padding_mode != "zeros":
        return False  # reflect/replicate/circular copy values, which commute with a per-channel affine map
    return any(p != 0 for p in conv._reversed_padding_repeated_twice)


class _Folder:
    """Accumulates folds in float64 working copies and writes them back once."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.work: dict[int, tuple[nn.Module, np.ndarray, np.ndarray | None]] = {}
        self.rewritten: dict[str, str] = {}

    def _weights(self, module: nn.Module) -> tuple[np.ndarray, np.ndarray | None]:
        if id(module) not in self.work:
            w = module.weight.detach().to(torch.float64).cpu().numpy()
            b = None if module.bias is None else module.bias.detach().to(torch.float64).cpu().numpy()
            self.work[id(module)] = (module, w, b)
        _, w, b = self.work[id(module)]
        return w, b

    @staticmethod
    def _affine(bn: nn.Module) -> tuple[np.ndarray, np.ndarray]:
        as64 = lambda t: None if t is None else t.detach().to(torch.float64).cpu().numpy()  # noqa: E731
        return batchnorm_affine(as64(bn.weight), as64(bn.bias), as64(bn.running_mean), as64(bn.running_var), bn.eps)

    def into_producer(self, producer_name: str, bn_name: str) -> None:
        producer, bn = self.model.get_submodule(producer_name), self.model.get_submodule(bn_name)
        self.rewritten[f"{producer_name}.weight"] = bn_name
        w, b = self._weights(producer)
        scale, shift = self._affine(bn)
        groups = getattr(producer, "groups", 1)
        self.work[id(producer)] = (producer, *fold_into_producer(w, b, scale, shift, _layout(producer), groups))

    def into_consumer(self, conv_name: str, bn_name: str) -> None:
        conv, bn = self.model.get_submodule(conv_name), self.model.get_submodule(bn_name)
        self.rewritten[f"{conv_name}.weight"] = bn_name
        w, b = self._weights(conv)
        scale, shift = self._affine(bn)
        self.work[id(conv)] = (conv, *fold_into_conv_input(w, b, scale, shift, conv.groups))

    def write_back(self, bn_names: list[str]) -> None:
        with torch.no_grad():
            for module, w, b in self.work.values():
                dtype, device = module.weight.dtype, module.weight.device
                module.weight.copy_(torch.from_numpy(w).to(dtype=dtype, device=device))
                bias = torch.from_numpy(b).to(dtype=dtype, device=device)
                if module.bias is None:
                    module.bias = nn.Parameter(bias, requires_grad=module.weight.requires_grad)
                else:
                    module.bias.copy_(bias)
        targets = {id(self.model.get_submodule(name)) for name in bn_names}
        for name, module in list(self.model.named_modules(remove_duplicate=False)):
            for child_name, child in list(module.named_children()):
                if id(child) in targets:
                    setattr(module, child_name, nn.Identity())


def _shared_tensor_owners(model: nn.Module) -> dict[int, set[int]]:
    """Map id(parameter or buffer) -> ids of the module objects that hold it."""
    owners: dict[int, set[int]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None:
                owners.setdefault(id(tensor), set()).add(id(module))
    return owners


def _tensors_shared(module: nn.Module, owners: dict[int, set[int]]) -> bool:
    tensors = (*module._parameters.values(), *module._buffers.values())
    return any(t is not None and len(owners.get(id(t), ())) > 1 for t in tensors)


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return _is_producer(m) or _is_batchnorm(m) or super().is_leaf_module(m, module_qualified_name)


@holds_tracing
def _trace(model: nn.Module, example: torch.Tensor) -> torch.fx.Graph | None:
    """The model's dataflow graph with output shapes, or None where torch.fx cannot trace it."""
    from torch.fx.passes.shape_prop import ShapeProp

    try:
        tracer = _LeafTracer()
        graph = tracer.trace(model)
    except Exception as exc:  # noqa: BLE001 - any trace failure means: use the fallback
        logger.info("torch.fx cannot trace the model (%s); folding nn.Sequential neighbours only", exc)
        return None
    graph_module = torch.fx.GraphModule(tracer.root, graph)
    with torch.no_grad():
        try:
            ShapeProp(graph_module).propagate(example)
        except Exception as exc:  # noqa: BLE001 - shapes only sharpen the Linear check
            logger.info("shape propagation failed (%s); Linear -> BatchNorm1d is left to the ONNX pass", exc)
    return graph_module.graph


def _fold_on_fx_graph(model: nn.Module, graph: torch.fx.Graph) -> TorchFoldResult:
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    attr_roots = {str(n.target).rsplit(".", 1)[0] for n in graph.nodes if n.op == "get_attr"}
    owners = _shared_tensor_owners(model)
    result, folder, folded_bns = TorchFoldResult(method="fx"), _Folder(model), []

    def module_problem(name: str, module: nn.Module) -> str | None:
        if calls[name] > 1:
            return f"module '{name}' is called at {calls[name]} call sites"
        if name in attr_roots or _tensors_shared(module, owners):
            return f"the weights of '{name}' are shared with another call site"
        return None

    for node in graph.nodes:
        if node.op != "call_module" or not _is_batchnorm(model.get_submodule(node.target)):
            continue
        bn_name, bn = node.target, model.get_submodule(node.target)
        problem = _batchnorm_problem(bn) or module_problem(bn_name, bn)
        if problem is None and (len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], torch.fx.Node)):
            problem = "BatchNorm is called with unusual arguments"
        if problem:
            result.skipped[bn_name] = problem
            continue
        source = node.args[0]
        producer_problem = _producer_problem(model, source, node, module_problem)
        if producer_problem is None:
            folder.into_producer(source.target, bn_name)
            folded_bns.append(bn_name)
            continue
        consumer_problem = _consumer_problem(model, node, module_problem)
        if consumer_problem is None:
            folder.into_consumer(next(iter(node.users)).target, bn_name)
            folded_bns.append(bn_name)
            continue
        result.skipped[bn_name] = f"not into its producer ({producer_problem}) nor its consumer ({consumer_problem})"
    folder.write_back(folded_bns)
    result.folded, result.rewritten = folded_bns, folder.rewritten
    return result


def _producer_problem(
    model: nn.Module, source: torch.fx.Node, bn_node: torch.fx.Node, module_problem: ModuleCheck
) -> str | None:
    if source.op != "call_module" or not _is_producer(model.get_submodule(source.target)):
        return f"input comes from {source.op} '{source.target}', not a conv or linear module"
    producer = model.get_submodule(source.target)
    if len(source.users) != 1:
        return f"the output of '{source.target}' is used {len(source.users)} times"
    problem = module_problem(source.target, producer)
    if problem:
        return problem
    if isinstance(producer, nn.Linear):
        meta = source.meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            return "the rank of the Linear output is unknown"
        if len(meta.shape) != 2:
            return (
                f"Linear output is {len(meta.shape)}-D: BatchNorm normalises axis 1, "
                "not the Linear's feature axis"
            )
    out_channels = producer.out_features if isinstance(producer, nn.Linear) else producer.out_channels
    bn = model.get_submodule(bn_node.target)
    if out_channels != bn.num_features:
        return f"'{source.target}' has {out_channels} outputs, the BatchNorm {bn.num_features} channels"
    return None


def _consumer_problem(model: nn.Module, bn_node: torch.fx.Node, module_problem: ModuleCheck) -> str | None:
    users = list(bn_node.users)
    if len(users) != 1:
        return f"the BatchNorm output is used {len(users)} times"
    user = users[0]
    if user.op != "call_module" or not _is_standard(model.get_submodule(user.target), _CONVS):
        return f"its output goes to {user.op} '{user.target}', not a convolution module"
    conv = model.get_submodule(user.target)
    if len(user.args) != 1 or user.args[0] is not bn_node or user.kwargs:
        return f"'{user.target}' is called with unusual arguments"
    problem = module_problem(user.target, conv)
    if problem:
        return problem
    if _pads_with_zeros(conv):
        return f"'{user.target}' pads with zeros (padding={conv.padding})"
    if conv.in_channels != model.get_submodule(bn_node.target).num_features:
        return f"'{user.target}' reads {conv.in_channels} channels"
    return None


def _child_name(container_name: str, child_name: str) -> str:
    return f"{container_name}.{child_name}" if container_name else child_name


def _fold_in_sequentials(model: nn.Module, example: torch.Tensor) -> TorchFoldResult:
    """Fallback for models torch.fx cannot trace: adjacent children of plain nn.Sequential."""
    calls: Counter[int] = Counter()
    output_rank: dict[int, int] = {}

    def hook(module: nn.Module, _inputs, output) -> None:
        calls[id(module)] += 1
        if isinstance(output, torch.Tensor):
            output_rank[id(module)] = output.dim()

    handles = [m.register_forward_hook(hook) for m in model.modules() if _is_producer(m) or _is_batchnorm(m)]
    try:
        with torch.no_grad():
            model(example)
    finally:
        for handle in handles:
            handle.remove()
    owners = _shared_tensor_owners(model)
    result, folder, folded_bns = TorchFoldResult(method="modules"), _Folder(model), []

    def single_use(module: nn.Module) -> bool:
        return calls[id(module)] == 1 and not _tensors_shared(module, owners)

    for container_name, container in model.named_modules():
        if type(container).forward is not nn.Sequential.forward:
            continue
        children = list(container.named_children())
        for index, (child_name, bn) in enumerate(children):
            if not _is_batchnorm(bn):
                continue
            bn_name = _child_name(container_name, child_name)
            if _batchnorm_problem(bn) or not single_use(bn):
                continue
            before = children[index - 1][1] if index else None
            after = children[index + 1][1] if index + 1 < len(children) else None
            if (
                before is not None
                and _is_producer(before)
                and single_use(before)
                and (not isinstance(before, nn.Linear) or output_rank.get(id(before)) == 2)
                and (before.out_features if isinstance(before, nn.Linear) else before.out_channels) == bn.num_features
            ):
                folder.into_producer(_child_name(container_name, children[index - 1][0]), bn_name)
                folded_bns.append(bn_name)
            elif (
                after is not None
                and _is_standard(after, _CONVS)
                and single_use(after)
                and not _pads_with_zeros(after)
                and after.in_channels == bn.num_features
            ):
                folder.into_consumer(_child_name(container_name, children[index + 1][0]), bn_name)
                folded_bns.append(bn_name)
    for name, module in model.named_modules():
        if _is_batchnorm(module) and name not in folded_bns:
            result.skipped[name] = "torch.fx cannot trace the model and it has no foldable nn.Sequential neighbour"
    folder.write_back(folded_bns)
    result.folded, result.rewritten = folded_bns, folder.rewritten
    return result


def fold_batchnorm_modules(model: nn.Module, example: torch.Tensor) -> TorchFoldResult:
    """Fold every legal BN of ``model`` (in eval mode, modified in place) into its neighbour.

    Folded BN modules are replaced by ``nn.Identity``; the folded weights are computed in
    float64 and stored in the model's dtype. ``example`` is one input batch, used to learn
    output ranks (Linear -> BN1d is legal only on 2-D input) and call counts.
    """
    traced = _trace(model, example)
    if traced is None:
        return _fold_in_sequentials(model, example)
    return _fold_on_fx_graph(model, traced)
