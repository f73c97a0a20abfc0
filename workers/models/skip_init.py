"""Building a model whose every weight a checkpoint is about to fill, without its random
initialization (docs/models.md, "Loading without initializing").

An architecture's constructor fills its parameters with random values (kaiming, trunc-normal,
...) that a strict load then overwrites: for a resnet18 that is 0.2 s of the 0.4 s a build
takes, paid by the job's host and by every rank for every model, and a sweep builds its cells'
models again and again. So the model is built on the meta device (shapes only), given
uninitialized CPU memory (``nn.Module.to_empty``) and its BN running statistics reset as its
constructor would (a legacy checkpoint without ``num_batches_tracked`` keeps the constructor's
0); the strict load that follows writes every other value.

Only where that is exactly a real build followed by the load: any tensor the load would not
write (a non-persistent buffer, a tensor kept outside the parameters and buffers, a lazy
module) or a parameter shared between modules (``to_empty`` would untie it) builds the model
for real instead, as does a constructor that cannot run on the meta device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.lazy import LazyModuleMixin

from bnrecal.workers.models.architectures import build_model


def build_for_weights(
    arch: str, model_kwargs: Mapping[str, Any] | None = None, *, allowed_modules: Sequence[str] = (),
) -> nn.Module:
    """``build_model`` of ``arch`` for a strict load of a full state dict that follows: its
    random initialization skipped where the load overwrites all of it, else a real build."""
    try:
        with torch.device("meta"):
            model = build_model(arch, model_kwargs, allowed_modules=allowed_modules, device="meta")
    except Exception:  # noqa: BLE001 - e.g. a constructor that needs real values (``.item()``): a real build,
        return build_model(arch, model_kwargs, allowed_modules=allowed_modules)  # which raises what is really wrong
    if not _all_loaded(model):
        return build_model(arch, model_kwargs, allowed_modules=allowed_modules)
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, _NormBase):
            module.reset_running_stats()
    return model


def _all_loaded(model: nn.Module) -> bool:
    """Whether a strict load of ``model``'s state dict writes every tensor it holds, and no
    parameter is shared (on the meta device: nothing is allocated)."""
    persistent = set(model.state_dict(keep_vars=True))
    named = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    buffers = [name for name, _ in model.named_buffers(remove_duplicate=False)]
    shared = len(named) != len(dict(model.named_parameters())) or len(buffers) != len(dict(model.named_buffers()))
    if shared or set(named + buffers) - persistent:
        return False
    for module in model.modules():
        if isinstance(module, LazyModuleMixin):
            return False
        if any(_holds_tensor(value) for key, value in vars(module).items()
               if key not in ("_parameters", "_buffers", "_modules")):
            return False
    return True


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is a tensor or a list, tuple or dict holding one (two levels deep)."""
    if isinstance(value, torch.Tensor):
        return True
    if depth < 2 and isinstance(value, (list, tuple)):
        return any(_holds_tensor(item, depth + 1) for item in value)
    if depth < 2 and isinstance(value, dict):
        return any(_holds_tensor(item, depth + 1) for item in value.values())
    return False
