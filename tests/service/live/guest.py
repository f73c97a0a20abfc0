"""What "only the BN statistics changed" means for a caller's model (docs/python.md, "What
differs, and why"), checked against a snapshot taken before the call, and an independent
reference for models whose batches are not one tensor (lists of images, varying shapes)."""

from __future__ import annotations

import io
from copy import deepcopy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

BN_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything of ``model`` a recalibration must leave as it was: per module its
    ``training`` flag, its attribute names, every tensor attribute (object, type, values,
    dtype, device, strides, ``requires_grad``), every parameter and non-BN buffer likewise,
    and its hooks (which functions, in which order)."""
    state: dict[str, Any] = {"#deep-copies": _works(lambda: deepcopy(model)),
                             "#saves": _works(lambda: torch.save(model, io.BytesIO()))}
    bn = {id(m) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    for name, module in model.named_modules():
        state[f"{name}#training"] = module.training
        state[f"{name}#attributes"] = sorted(vars(module))
        state[f"{name}#hooks"] = [
            (kind, key, hook) for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                           "_forward_hooks_with_kwargs", "_state_dict_hooks")
            for key, hook in getattr(module, kind, {}).items()
        ]
        tensors = {f"attr.{k}": v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}
        tensors |= {f"param.{k}": v for k, v in module._parameters.items() if v is not None}
        tensors |= {
            f"buffer.{k}": v for k, v in module._buffers.items()
            if v is not None and not (id(module) in bn and k in BN_RUNNING)
        }
        for key, value in tensors.items():
            state[f"{name}.{key}"] = _tensor_facts(value)
    return state


def assert_untouched(before: dict[str, Any], model: nn.Module, sample: Callable[[nn.Module], Any]) -> None:
    """Nothing in :func:`snapshot` changed, the model deep-copies and saves where it did
    before (a pruned model does neither), and it runs (``sample(model)``: in train mode
    that moves its BN statistics, so check them first)."""
    after = snapshot(model)
    assert after.keys() == before.keys(), sorted(set(after) ^ set(before))
    for key, facts in before.items():
        if isinstance(facts, tuple) and facts and facts[0] == "tensor":
            got = after[key]
            assert got[:-1] == facts[:-1], f"{key}: {got[:-1]} != {facts[:-1]}"
            assert torch.equal(got[-1], facts[-1]), f"{key} changed"
        else:
            assert after[key] == facts, f"{key}: {after[key]} != {facts}"
    if before["#deep-copies"]:
        deepcopy(model)
    if before["#saves"]:
        torch.save(model, io.BytesIO())
    with torch.no_grad():
        sample(model)


def hooked_reference(
    model: nn.Module, batches: Iterable[Any], call: Callable[[nn.Module, Any], Any], copy: bool = True
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each BN layer's float64 mean and unbiased variance of every value it sees when a
    copy of ``model`` runs in eval mode with its BN layers normalising with batch
    statistics (train mode), one step per batch: forward pre-hooks collect the inputs.
    Independent of the engine: the model's own code, torch's own BN. ``copy=False`` runs
    (and changes) ``model`` itself."""
    reference = (deepcopy(model) if copy else model).eval()
    seen: dict[str, list[torch.Tensor]] = {}
    for name, module in reference.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            module.train()

            def collect(mod: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                x = args[0].detach().double()
                seen.setdefault(name, []).append(x.transpose(0, 1).reshape(x.shape[1], -1))

            module.register_forward_pre_hook(collect)
    with torch.no_grad():
        for batch in batches:
            call(reference, batch)
    return {name: (torch.cat(v, 1).mean(1), torch.cat(v, 1).var(1)) for name, v in seen.items()}


def assert_statistics(model: nn.Module, expected: dict[str, tuple[torch.Tensor, torch.Tensor]], rel: float = 1e-4) -> None:
    """Every BN layer of ``model`` carries ``expected`` (docs/calibration.md, "Accuracy")."""
    assert expected
    modules = dict(model.named_modules())
    for name, (mean, var) in expected.items():
        layer = modules[name]
        std = var.clamp_min(1e-12).sqrt()
        got_mean, got_var = layer.running_mean.double().cpu(), layer.running_var.double().cpu()
        assert ((got_mean - mean).abs() <= rel * std + mean.abs() * 2**-23 + 1e-7).all(), name
        assert ((got_var - var).abs() <= rel * var + 1e-9).all(), name


def _tensor_facts(value: torch.Tensor) -> tuple[Any, ...]:
    return ("tensor", id(value), type(value).__name__, value.dtype, value.device, tuple(value.shape), value.stride(),
            value.requires_grad, value.detach().clone())


def _works(action: Callable[[], Any]) -> bool:
    try:
        action()
    except Exception:  # noqa: BLE001 - whether it works is the question
        return False
    return True
