"""The batch-norm calls of a program's graph, recognised by their running buffers.

Every call of a known batch-norm form (``workers.engine.bn_calls``) whose running mean and
variance are buffers of the program is a BN layer, named by the buffers' module path
(``layer1.0.bn1``); a layer called twice is one layer with two calls. A call without
running buffers normalises with batch statistics (``track_running_stats=False``) and
is listed as skipped. Everything that would make the statistics wrong or unknowable is
refused, naming the node: a batch-norm op of a form bnrecal does not know, running
statistics that are parameters, constants or computed values, running buffers that
other nodes read too, and programs exported in training mode (their dropout is on and
their batch norm updates the buffers in place).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from bnrecal.workers.engine.bn_calls import BATCH_NORM_FORMS, form_of, looks_like_batch_norm

from bnrecal.errors import ProgramError

aten = torch.ops.aten

_DROPOUTS = {
    aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default,
    aten.alpha_dropout.default, aten.feature_alpha_dropout.default,
}


@dataclass(frozen=True)
class LayerSite:
    """One BN layer of a program: its name, its buffers' container, class and eps."""

    name: str
    owner: str
    kind: str
    eps: float
    mean_name: str = "running_mean"
    var_name: str = "running_var"


@dataclass
class BatchNormSites:
    """The program's BN layers, its batch-statistics calls, and the nodes that run once
    per forward on the whole batch (every batch-norm call)."""

    layers: list[LayerSite] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    batchwise: set[Any] = field(default_factory=set)


def find_sites(program: Any, sources: dict[Any, tuple[str, str]], label: str) -> BatchNormSites:
    """Every batch-norm call of ``program``'s graph; ``sources`` maps its placeholders to
    the (container, attribute) each tensor is held at."""
    specs = {
        node: spec for node, spec in zip(program.graph.find_nodes(op="placeholder"), program.graph_signature.input_specs)
    }
    sites = BatchNormSites()
    statistics: set[Any] = set()
    seen: dict[str, LayerSite] = {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _DROPOUTS and _dropout_on(node):
            raise ProgramError(
                f"program {label} was exported in training mode (node {node.name!r}: dropout is on); "
                "export the model after model.eval()"
            )
        form = form_of(node.target)
        if form is None:
            if looks_like_batch_norm(node.target):
                raise ProgramError(
                    f"program {label}: node {node.name!r} calls {node.target}, a form of batch norm bnrecal cannot "
                    "calibrate (it knows aten.batch_norm and the _native_batch_norm_legit family)"
                )
            continue
        call = form.bind(node.args, node.kwargs)
        mean, var = call.running_mean, call.running_var
        sites.batchwise.add(node)
        if mean is None and var is None:
            sites.skipped.append((_module_path(node), "track_running_stats=False: the layer keeps no running statistics"))
            continue
        if form.training_only or call.training is True:
            raise ProgramError(
                f"program {label} was exported in training mode (node {node.name!r}: {form.name} updates its running "
                "statistics); export the model after model.eval()"
            )
        mean_source = _buffer(node, mean, specs, sources, "running mean", label)
        var_source = _buffer(node, var, specs, sources, "running variance", label)
        if mean_source[0] != var_source[0]:
            raise ProgramError(
                f"program {label}: node {node.name!r} normalises with buffers of two modules "
                f"({_path(mean_source)}, {_path(var_source)})"
            )
        statistics.update((mean, var))
        site = LayerSite(
            name=mean_source[0], owner=mean_source[0], kind=_kind(node), eps=call.eps,
            mean_name=mean_source[1], var_name=var_source[1],
        )
        if site.name not in seen:
            seen[site.name] = site
            sites.layers.append(site)
    for buffer in statistics:
        for user in buffer.users:
            if user.target not in BATCH_NORM_FORMS:
                raise ProgramError(
                    f"program {label}: running buffer {_path(sources[buffer])!r} is also read by node {user.name!r} "
                    f"({user.target}), not only by batch norm; its statistics cannot be replaced safely"
                )
    return sites


def _buffer(
    node: Any, value: Any, specs: dict[Any, Any], sources: dict[Any, tuple[str, str]], what: str, label: str
) -> tuple[str, str]:
    """Where a batch-norm call's running statistic is held: it must be a program buffer."""
    spec = specs.get(value) if isinstance(value, torch.fx.Node) else None
    kind = spec.kind.name if spec is not None else None
    if kind == "BUFFER":
        return sources[value]
    described = {"PARAMETER": "a parameter", "CONSTANT_TENSOR": "a constant", "USER_INPUT": "an input"}.get(
        kind or "", "a value computed in the graph" if isinstance(value, torch.fx.Node) else f"{value!r}"
    )
    target = f" ({spec.target})" if spec is not None and spec.target else ""
    raise ProgramError(
        f"program {label}: node {node.name!r} normalises with {described}{target} as its {what}, not a buffer: "
        "bnrecal recalibrates running buffers only (register running statistics with register_buffer)"
    )


def _dropout_on(node: Any) -> bool:
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", False)
    return train is True


def _module_stack(node: Any) -> list[tuple[str, str]]:
    stack = node.meta.get("nn_module_stack") or {}
    return [value for value in stack.values() if isinstance(value, tuple) and len(value) == 2]


def _module_path(node: Any) -> str:
    """The module path a node comes from (the innermost module of its stack), else its name."""
    stack = _module_stack(node)
    return str(stack[-1][0]) if stack and stack[-1][0] else node.name


def _kind(node: Any) -> str:
    """The class of the module a batch-norm call comes from (``BatchNorm2d``, ``BatchNormAct2d``)."""
    stack = _module_stack(node)
    if stack:
        return str(stack[-1][1]).rsplit(".", 1)[-1] or "BatchNorm"
    return "BatchNorm"


def _path(source: tuple[str, str]) -> str:
    return f"{source[0]}.{source[1]}" if source[0] else source[1]
