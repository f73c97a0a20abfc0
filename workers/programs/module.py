"""A ``torch.export`` program as a module the engine can calibrate, evaluate and export.

:class:`ProgramModule` holds the program's parameters and buffers under their module
paths (``layer1.0.bn1.running_mean``) and runs its graph node by node. Its batch-norm
calls are found in the graph (``sites.py``): the calibrator recognises each by its running
buffers, as it does a module's ``F.batch_norm`` call, so a program's statistics are the
same as its eager model's.

A program may take any batch size (a dynamic batch dimension) or only the one it was
exported with. Where a rank's slice does not fit, the graph runs on chunks of a size the
program takes (the last one padded by repeating its last sample), every node once per
chunk, except the batch-norm calls: those run once on the real samples of all chunks
together, so each normalises with the statistics of the whole step, exactly as a
dynamic program would. Padding rows never reach a statistic and are cut from the output.
This is exact for programs that treat samples independently apart from batch norm,
which is what a static batch of 1 already implies.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bnrecal.workers.engine.batchnorm import BatchNormLayer, SkippedLayer

from bnrecal.errors import ModelInputError, ProgramError
from .sites import BatchNormSites, find_sites

_KEEP = frozenset(dir(nn.Module()))


class _Chunks(list):  # type: ignore[type-arg]
    """One value per chunk of a chunked forward."""


@dataclass(frozen=True)
class BatchRule:
    """The batch sizes a program takes: exactly ``low`` (static), or ``low..high``."""

    low: int
    high: int | None
    static: bool

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """How to run ``n`` samples: (real samples, chunk size) per chunk."""
        if self.static:
            size = self.low
            return [(min(size, n - start), size) for start in range(0, n, size)]
        if (self.high is None or n <= self.high) and n >= self.low:
            return [(n, n)]
        if n < self.low:
            return [(n, self.low)]
        assert self.high is not None
        parts = []
        for start in range(0, n, self.high):
            real = min(self.high, n - start)
            parts.append((real, max(real, self.low)))
        return parts

    def describe(self) -> str:
        """The rule in words, for messages and the report."""
        if self.static:
            return f"a static batch of {self.low}"
        return f"a dynamic batch of {self.low}..{self.high if self.high is not None else 'any'}"


@dataclass(frozen=True)
class ProgramInput:
    """One tensor input of the program: its name, dtype and one sample's shape
    (None where a dimension is dynamic)."""

    name: str
    dtype: torch.dtype
    sample_shape: tuple[int | None, ...]


class ProgramModule(nn.Module):
    """Runs a ``torch.export`` program; its weights are this module's parameters and buffers."""

    def __init__(self, program: Any, label: str = "program") -> None:
        super().__init__()
        self.label = label
        signature = program.graph_signature
        self._graph = program.graph
        self._sources: dict[Any, tuple[str, str]] = {}
        self._user: list[Any] = []
        for node, spec in zip(program.graph.find_nodes(op="placeholder"), signature.input_specs, strict=True):
            kind = spec.kind.name
            if kind == "USER_INPUT":
                self._user.append(node)
            elif kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
                tensor = _tensor_of(program, spec)
                self._sources[node] = self._hold(spec.target, tensor, kind, getattr(spec, "persistent", True))
            else:
                raise ProgramError(f"program {label} takes a {kind.lower()} input, which bnrecal does not run")
        outputs = [i for i, spec in enumerate(signature.output_specs) if spec.kind.name == "USER_OUTPUT"]
        self._outputs = outputs
        self.inputs = [_program_input(node, label) for node in self._user]
        self.batch = _batch_rule(self._user, program.range_constraints, label)
        self.sites: BatchNormSites = find_sites(program, self._sources, label)
        self._nodes = [node for node in program.graph.nodes if node.op in ("placeholder", "call_function", "output")]
        if any(node.op == "get_attr" for node in program.graph.nodes):
            raise ProgramError(f"program {label} reads attributes of submodules (a higher-order op), which bnrecal does not run")
        self._forget = _last_uses(self._nodes)

    def _hold(self, target: str, tensor: torch.Tensor, kind: str, persistent: bool) -> tuple[str, str]:
        """Register one tensor at its module path; returns (container path, attribute)."""
        if kind == "CONSTANT_TENSOR":
            target = "_program_constants." + "".join(c if c.isalnum() else "_" for c in target)
        parts = target.split(".")
        if not all(part and part.isprintable() for part in parts) or parts[0] in _KEEP:
            raise ProgramError(f"program {self.label} has a tensor named {target[:120]!r}, which bnrecal cannot hold")
        owner: nn.Module = self
        for part in parts[:-1]:
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        name = parts[-1]
        if kind == "PARAMETER":
            owner.register_parameter(name, nn.Parameter(tensor.detach(), requires_grad=False))
        else:
            owner.register_buffer(name, tensor.detach(), persistent=persistent and kind == "BUFFER")
        return ".".join(parts[:-1]), name

    def __deepcopy__(self, memo: dict[int, Any]) -> ProgramModule:
        """A copy with its own parameters and buffers; the graph and what was read from it
        are shared (they never change, and copying a graph node by node recurses deeply)."""
        for shared in (self._graph, self._sources, self._user, self._outputs, self.inputs, self.batch, self.sites,
                       self._nodes, self._forget):
            memo[id(shared)] = shared
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            clone.__dict__[key] = copy.deepcopy(value, memo)
        return clone

    def batchnorm_layers(self) -> tuple[list[BatchNormLayer], list[SkippedLayer]]:
        """The program's BN layers (one per pair of running buffers, in graph order) and
        its batch-statistics calls (``track_running_stats=False``), as skipped layers."""
        layers = [
            BatchNormLayer(
                site.name, self.get_submodule(site.owner), kind=site.kind, eps=site.eps,
                mean_name=site.mean_name, var_name=site.var_name,
            )
            for site in self.sites.layers
        ]
        skipped = [SkippedLayer(name, reason) for name, reason in self.sites.skipped]
        return layers, skipped

    def forward(self, x: torch.Tensor, *others: torch.Tensor) -> Any:
        """Run the program on a batch of any size (chunked where the program needs it).

        ``x`` is its first input (a named parameter, so exporters can give it a dynamic
        batch dimension), ``others`` the rest of a program that takes several."""
        if torch.compiler.is_exporting():  # an exporter traces it: one piece, its batch left symbolic
            values = self._run([value.to(spec.dtype) for spec, value in zip(self.inputs, (x, *others))], None)
            return values[0] if len(values) == 1 else tuple(values)
        tensors = self._check_inputs((x, *others))
        n = int(tensors[0].shape[0])
        plan = self.batch.chunks(n)
        if len(plan) == 1 and plan[0][0] == plan[0][1]:
            values = self._run(tensors, None)
        else:
            values = self._run(_split(tensors, plan), plan)
        return values[0] if len(values) == 1 else tuple(values)

    def _check_inputs(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        if len(inputs) != len(self.inputs):
            names = ", ".join(i.name for i in self.inputs)
            raise ModelInputError(f"program {self.label} takes {len(self.inputs)} inputs ({names}), got {len(inputs)}")
        tensors = []
        for spec, value in zip(self.inputs, inputs):
            shape = tuple(value.shape[1:])
            if len(shape) != len(spec.sample_shape) or any(
                want is not None and want != got for want, got in zip(spec.sample_shape, shape)
            ):
                wanted = ", ".join("?" if d is None else str(d) for d in spec.sample_shape)
                raise ModelInputError(
                    f"program {self.label} takes {spec.name!r} samples of shape ({wanted}), got {shape}"
                )
            tensors.append(value.to(spec.dtype))
        if len({int(t.shape[0]) for t in tensors}) != 1:
            raise ModelInputError(f"program {self.label}: its inputs have different batch sizes")
        return tensors

    def _run(self, inputs: Sequence[Any], plan: list[tuple[int, int]] | None) -> list[Any]:
        env: dict[Any, Any] = {}
        user = iter(inputs)
        result: list[Any] = []
        for node in self._nodes:
            if node.op == "placeholder":
                source = self._sources.get(node)
                env[node] = next(user) if source is None else _attribute(self, source)
            elif node.op == "call_function":
                env[node] = self._call(node, _load(node.args, env), _load(node.kwargs, env), plan)
            else:
                values = node.args[0]
                values = [values] if isinstance(values, torch.fx.Node) else list(values)
                result = [_gather(env[values[i]], plan, self.label) if plan else env[values[i]] for i in self._outputs]
            for done in self._forget.get(node, ()):
                env.pop(done, None)
        return result

    def _call(self, node: Any, args: Any, kwargs: Any, plan: list[tuple[int, int]] | None) -> Any:
        target: Callable[..., Any] = node.target
        if plan is None or not _chunked(args, kwargs):
            return target(*args, **kwargs)
        if node in self.sites.batchwise:
            return _batchwise(target, args, kwargs, plan, self.label)
        return _Chunks(target(*_pick(args, i), **_pick(kwargs, i)) for i in range(len(plan)))


def _tensor_of(program: Any, spec: Any) -> torch.Tensor:
    target = spec.target
    if spec.kind.name == "PARAMETER" or (spec.kind.name == "BUFFER" and getattr(spec, "persistent", True)):
        return program.state_dict[target]
    return program.constants[target]


def _attribute(module: nn.Module, source: tuple[str, str]) -> torch.Tensor:
    owner = module.get_submodule(source[0]) if source[0] else module
    return getattr(owner, source[1])


def _program_input(node: Any, label: str) -> ProgramInput:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() < 1:
        raise ProgramError(f"program {label}: input {node.name!r} is not a batched tensor (bnrecal feeds tensors of samples)")
    shape = tuple(int(d) if isinstance(d, int) else None for d in value.shape[1:])
    return ProgramInput(node.name, value.dtype, shape)


def _batch_rule(user: Sequence[Any], ranges: dict[Any, Any], label: str) -> BatchRule:
    """The batch sizes the program's inputs take (every input must agree)."""
    if not user:
        raise ProgramError(f"program {label} takes no tensor input")
    dims = [node.meta["val"].shape[0] for node in user]
    names = {str(d) for d in dims}
    if len(names) != 1:
        raise ProgramError(f"program {label}: its inputs disagree on the batch dimension ({', '.join(sorted(names))})")
    dim = dims[0]
    if isinstance(dim, int):
        return BatchRule(dim, dim, static=True)
    expression = dim.node.expr
    bounds = ranges.get(expression)
    low = _finite(bounds.lower) if bounds is not None else None
    high = _finite(bounds.upper) if bounds is not None else None
    low = 0 if low is None else low
    return BatchRule(max(low, 1), high, static=False)


def _finite(bound: Any) -> int | None:
    """A range bound as an int, None where it is infinite."""
    try:
        return int(bound) if bool(bound.is_Integer) else None
    except (TypeError, ValueError, AttributeError):
        return None


def _last_uses(nodes: Sequence[Any]) -> dict[Any, list[Any]]:
    """For each node, the values no node after it reads (freed as the forward goes)."""
    last: dict[Any, Any] = {}
    for node in nodes:
        for used in node.all_input_nodes:
            last[used] = node
    forget: dict[Any, list[Any]] = {}
    for value, user in last.items():
        forget.setdefault(user, []).append(value)
    return forget


def _split(tensors: Sequence[torch.Tensor], plan: list[tuple[int, int]]) -> list[_Chunks]:
    """Each input cut into the plan's chunks, the last padded by repeating its last sample."""
    result = []
    for tensor in tensors:
        chunks, start = _Chunks(), 0
        for real, size in plan:
            chunks.append(_pad(tensor[start : start + real], size))
            start += real
        result.append(chunks)
    return result


def _pad(part: torch.Tensor, size: int) -> torch.Tensor:
    if part.shape[0] == size:
        return part
    return torch.cat([part, part[-1:].expand(size - part.shape[0], *part.shape[1:])])


def _map(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` (a node argument: nested tuples, lists and dicts) with ``leaf`` applied to
    everything else, ``_Chunks`` included (a value per chunk is a leaf, not a list)."""
    if isinstance(value, (torch.fx.Node, _Chunks)):
        return leaf(value)
    if isinstance(value, tuple):
        return tuple(_map(v, leaf) for v in value)
    if isinstance(value, list):
        return [_map(v, leaf) for v in value]
    if isinstance(value, dict):
        return {k: _map(v, leaf) for k, v in value.items()}
    return leaf(value)


def _load(value: Any, env: dict[Any, Any]) -> Any:
    """A node's argument with every node replaced by its value."""
    return _map(value, lambda v: env[v] if isinstance(v, torch.fx.Node) else v)


def _chunked(*values: Any) -> bool:
    """Whether any argument holds a value per chunk."""
    for value in values:
        if isinstance(value, _Chunks):
            return True
        if isinstance(value, (tuple, list)) and _chunked(*value):
            return True
        if isinstance(value, dict) and _chunked(*value.values()):
            return True
    return False


def _pick(value: Any, index: int) -> Any:
    """An argument as chunk ``index`` sees it: each value per chunk replaced by its own."""
    return _map(value, lambda v: v[index] if isinstance(v, _Chunks) else v)


def _batchwise(
    target: Callable[..., Any], args: Any, kwargs: Any, plan: list[tuple[int, int]], label: str
) -> _Chunks:
    """A batch-norm call once on the real samples of every chunk, split back per chunk.

    A call's input usually has the chunk's samples as its rows; where the program folded
    more into them (LeViT's BatchNorm1d over every token), all rows of every chunk are
    the real samples' rows as long as no chunk is padded, and the call is refused where
    one is: which rows are padding is then unknowable.
    """
    chunks = args[0]
    padded = any(real != size for real, size in plan)
    if padded and any(chunk.shape[0] != size for chunk, (_, size) in zip(chunks, plan)):
        raise ModelInputError(
            f"program {label} normalises rows that are not its samples (a batch folded into other dimensions), "
            f"so a step that is not a multiple of its static batch ({plan[0][1]}) cannot be padded exactly; "
            "choose a batch size whose every worker's share is a multiple of it, or export with a dynamic batch"
        )
    rows = [real for real, _ in plan] if padded else [chunk.shape[0] for chunk in chunks]
    joined = torch.cat([chunk[:count] for chunk, count in zip(chunks, rows)])
    result = target(joined, *args[1:], **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    parts = [_pad(part, chunk.shape[0]) for part, chunk in zip(torch.split(out, rows), chunks)]
    if isinstance(result, tuple):
        return _Chunks((part, *result[1:]) for part in parts)
    return _Chunks(parts)


def _gather(value: Any, plan: list[tuple[int, int]], label: str) -> Any:
    """One output of a chunked forward: the chunks' real rows joined."""
    if not isinstance(value, _Chunks):
        return value
    first = value[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0 and first.shape[0] == plan[0][1]:
        return torch.cat([chunk[:real] for chunk, (real, _) in zip(value, plan)])
    raise ModelInputError(
        f"program {label} returns an output without a batch dimension, so it cannot run on more samples than "
        "its static batch; export it with a dynamic batch (torch.export.Dim)"
    )
