"""The forms a batch-norm call takes, so the calibrator can recognise and answer each.

A module's BN layer normalises through ``torch.nn.functional.batch_norm`` (or, in some
subclasses, ``torch.batch_norm`` itself); a ``torch.export`` program through an ``aten``
op: ``aten.batch_norm`` in the default IR, ``_native_batch_norm_legit_no_training`` and
friends after ``run_decompositions()``. Each form names its arguments differently and
returns a different tuple; :class:`BatchNormForm` binds a call's arguments by name and
builds the result the caller expects (the normalised tensor first, then the batch
statistics, a reserve, or the running buffers a functional form hands back).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

aten = torch.ops.aten


class BatchNormCall(NamedTuple):
    """A batch-norm call's arguments by name, whatever its form calls or orders them:
    tensors in a forward, graph nodes and constants in a program's graph. ``training`` is
    None where the form has no such argument (the ``no_training`` forms). A named tuple:
    one is made on every BN call of every step, so it must cost no more than the dict it
    replaced."""

    input: Any
    running_mean: Any = None
    running_var: Any = None
    weight: Any = None
    bias: Any = None
    training: Any = None
    eps: float = 1e-5


@dataclass(frozen=True)
class BatchNormForm:
    """One way of calling batch norm: its parameter names, defaults and results."""

    name: str
    parameters: tuple[str, ...]
    defaults: dict[str, Any] = field(default_factory=dict)
    returns: int = 1
    functional: bool = False  # the last two results are the updated running buffers
    training_only: bool = False  # the form exists only in programs exported in training mode

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> BatchNormCall:
        """The call's arguments by name (``eps`` whatever the form calls it)."""
        named = dict(self.defaults)
        named.update(zip(self.parameters, args))
        named.update(kwargs)
        get, epsilon = named.get, named.get("epsilon")
        eps = get("eps", 1e-5) if epsilon is None else epsilon
        return BatchNormCall(  # positional: made on every BN call
            get("input"), get("running_mean"), get("running_var"), get("weight"), get("bias"), get("training"), float(eps)
        )

    def results(
        self, out: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, call: BatchNormCall
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What the call returns: ``out`` alone, or the form's tuple around it (the batch
        mean and inverse std it normalised with; the running buffers unchanged)."""
        if self.returns == 1:
            return out
        invstd = torch.rsqrt(var.to(torch.float32) + call.eps)
        values: list[torch.Tensor] = [out, mean.to(torch.float32), invstd]
        extra = self.returns - 3 - (2 if self.functional else 0)
        values += [torch.empty(0, dtype=torch.uint8, device=out.device)] * extra
        if self.functional:
            values += [call.running_mean.clone(), call.running_var.clone()]
        return tuple(values[: self.returns])


def _aten_form(op: Any, training_only: bool = False) -> BatchNormForm:
    schema = op._schema
    names = tuple(argument.name for argument in schema.arguments)
    returns = tuple(r.name for r in schema.returns)
    return BatchNormForm(
        name=f"aten.{schema.name.split('::')[-1]}.{op._overloadname}",
        parameters=names,
        returns=len(returns),
        functional=returns[-2:] == ("running_mean_out", "running_var_out"),
        training_only=training_only,
    )


_F_FORM = BatchNormForm(
    "torch.nn.functional.batch_norm",
    ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
    {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5},
)
_TORCH_FORM = BatchNormForm(
    "torch.batch_norm",
    ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps", "cudnn_enabled"),
)

BATCH_NORM_FORMS: dict[Callable[..., Any], BatchNormForm] = {
    F.batch_norm: _F_FORM,
    torch.batch_norm: _TORCH_FORM,
    torch.native_batch_norm: BatchNormForm(
        "torch.native_batch_norm",
        ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"),
        returns=3,
    ),
    aten.batch_norm.default: _aten_form(aten.batch_norm.default),
    aten.native_batch_norm.default: _aten_form(aten.native_batch_norm.default),
    aten._native_batch_norm_legit.default: _aten_form(aten._native_batch_norm_legit.default),
    aten._native_batch_norm_legit_no_training.default: _aten_form(aten._native_batch_norm_legit_no_training.default),
    aten._batch_norm_no_update.default: _aten_form(aten._batch_norm_no_update.default),
    aten.cudnn_batch_norm.default: _aten_form(aten.cudnn_batch_norm.default),
    aten.miopen_batch_norm.default: _aten_form(aten.miopen_batch_norm.default),
    aten._native_batch_norm_legit_functional.default: _aten_form(
        aten._native_batch_norm_legit_functional.default, training_only=True
    ),
    aten._batch_norm_with_update.default: _aten_form(aten._batch_norm_with_update.default, training_only=True),
    aten._batch_norm_with_update_functional.default: _aten_form(
        aten._batch_norm_with_update_functional.default, training_only=True
    ),
}
"""Every batch-norm call the calibrator answers, by the callable a ``TorchFunctionMode`` sees."""

BATCH_STATISTICS_FORMS: dict[Callable[..., Any], BatchNormForm] = {
    aten._native_batch_norm_legit.no_stats: _aten_form(aten._native_batch_norm_legit.no_stats),
}
"""Batch-norm calls that can only normalise with batch statistics (no running buffers):
what a ``track_running_stats=False`` layer becomes in a decomposed program."""


def form_of(target: Any) -> BatchNormForm | None:
    """The form of a call target, or None when it is no batch-norm call bnrecal knows."""
    return BATCH_NORM_FORMS.get(target) or BATCH_STATISTICS_FORMS.get(target)


def looks_like_batch_norm(target: Any) -> bool:
    """Whether a call target is some batch-norm operation, known or not (an unknown one
    is refused by name rather than run with stale statistics)."""
    return "batch_norm" in str(getattr(target, "__name__", "")) or "batch_norm" in str(target)
