"""An independent float64 single-process reference of contract section 1.

It does not share code with the engine: it runs a float64 copy of the model, each BN
module's own forward in torch's training mode (batch statistics, biased variance; only
the layer's own flag, its children such as timm's activation or drop path stay in eval
mode like the rest of the model), and collects every value each BN layer sees with
forward pre-hooks to compute the mean and the unbiased variance directly.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def reference_statistics(
    model: nn.Module, samples: torch.Tensor, batch_size: int, world_size: int = 1, mode: str = "sync"
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer name: (running_mean, running_var)}`` in float64, as the contract defines them."""
    reference = copy.deepcopy(model).double().eval()
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in reference.named_modules():
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            module.training = True
            seen[name] = []

            def keep(mod: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                x = args[0]
                seen[name].append(x.transpose(0, 1).reshape(x.shape[1], -1).clone())

            hooks.append(module.register_forward_pre_hook(keep))
    data = samples.double()
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            step = np.arange(start, min(start + batch_size, len(data)))
            if mode == "sync":
                reference(data[step])
            else:
                for part in np.array_split(step, world_size):
                    if part.size:
                        reference(data[part])
    for hook in hooks:
        hook.remove()
    result = {}
    for name, chunks in seen.items():
        values = torch.cat(chunks, dim=1)
        result[name] = (values.mean(dim=1), values.var(dim=1, unbiased=True))
    return result


def assert_matches_reference(
    model: nn.Module, reference: dict[str, tuple[torch.Tensor, torch.Tensor]], rel: float = 1e-4
) -> None:
    """Contract tolerances: |var err| <= rel * var and |mean err| <= rel * std, per channel.

    The mean is also allowed the rounding of the buffer that stores it (half an ulp of
    its dtype): a float32 running_mean of 1e3 cannot be closer than 3e-5 to the truth.
    """
    modules = dict(model.named_modules())
    for name, (mean, var) in reference.items():
        module = modules[name]
        got_mean = module.running_mean.double()
        got_var = module.running_var.double()
        std = var.sqrt().clamp_min(1e-30)
        storage = torch.finfo(module.running_mean.dtype).eps * mean.abs()
        mean_err = (((got_mean - mean).abs() - storage).clamp_min(0) / std).max().item()
        var_err = ((got_var - var).abs() / var.clamp_min(1e-30)).max().item()
        assert mean_err <= rel, f"{name}: running_mean off by {mean_err:.3g} std"
        assert var_err <= rel, f"{name}: running_var relative error {var_err:.3g}"
