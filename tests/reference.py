"""Independent references: float64 statistics (docs/calibration.md, "The statistics") and
evaluation metrics.

The statistics reference shares no code with the engine: it runs a float64 copy of the model, each BN
module's own forward in torch's training mode (batch statistics, biased variance; only
the layer's own flag, its children such as timm's activation or drop path stay in eval
mode like the rest of the model), and collects every value each BN layer sees with
forward pre-hooks to compute the mean and the unbiased variance directly.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def in_contract_order(samples: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The samples of a dataset given by path in the order bnrecal reads them
    (docs/calibration.md, "Order"; ``order: "shuffled"``, the default): numpy's PCG64
    permutation of all rows from ``seed``, written out here rather than taken from the
    engine. ``max_samples = M`` is the first M."""
    return samples[torch.from_numpy(np.random.Generator(np.random.PCG64(seed)).permutation(len(samples)))]


def reference_statistics(
    model: nn.Module,
    samples: torch.Tensor,
    batch_size: int,
    world_size: int = 1,
    mode: str = "sync",
    dtype: torch.dtype = torch.float64,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer name: (running_mean, running_var)}`` in float64, as docs/calibration.md
    defines them ("Result per BN layer").

    ``dtype`` is the precision the model runs in: float64 for the reference itself,
    float32 to tell a float32 model's own rounding from an error of the engine.
    """
    reference = copy.deepcopy(model).to(dtype).eval()
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in reference.named_modules():
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            module.training = True
            seen[name] = []

            def keep(mod: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                x = args[0]
                seen[name].append(x.transpose(0, 1).reshape(x.shape[1], -1).double())

            hooks.append(module.register_forward_pre_hook(keep))
    data = samples.to(dtype)
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
    model: nn.Module,
    reference: dict[str, tuple[torch.Tensor, torch.Tensor]],
    rel: float = 1e-4,
    float32_reference: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    noise_factor: float = 4.0,
) -> None:
    """The documented tolerances (docs/calibration.md, "Accuracy"): |var err| <= rel * var
    and |mean err| <= rel * std, per channel.

    The mean is also allowed the rounding of the buffer that stores it (half an ulp of
    its dtype): a float32 running_mean of 1e3 cannot be closer than 3e-5 to the truth.

    Deep in a float32 model, the values a layer sees already differ from the float64
    model's by the float32 forward's own rounding, amplified by the layers before it.
    With ``float32_reference`` (the same reference run in float32: torch's own
    training-mode BN), a layer where that rounding alone exceeds ``rel`` may be off by
    up to ``noise_factor`` times what torch's own float32 BN is off, and no more.
    """
    modules = dict(model.named_modules())
    for name, (mean, var) in reference.items():
        module = modules[name]
        got_mean, got_var = module.running_mean.double(), module.running_var.double()
        mean_err, var_err = _errors(got_mean, got_var, mean, var)
        mean_allowed = var_allowed = rel
        if float32_reference is not None:
            f32_mean, f32_var = float32_reference[name]
            f32_mean_err, f32_var_err = _errors(f32_mean.float().double(), f32_var.float().double(), mean, var)
            mean_allowed = max(rel, noise_factor * f32_mean_err)
            var_allowed = max(rel, noise_factor * f32_var_err)
        assert mean_err <= mean_allowed, f"{name}: running_mean off by {mean_err:.3g} std (allowed {mean_allowed:.3g})"
        assert var_err <= var_allowed, f"{name}: running_var relative error {var_err:.3g} (allowed {var_allowed:.3g})"


def _errors(
    got_mean: torch.Tensor, got_var: torch.Tensor, mean: torch.Tensor, var: torch.Tensor
) -> tuple[float, float]:
    """Worst channel's mean error in std (less the float32 storage rounding) and relative var error."""
    std = var.sqrt().clamp_min(1e-30)
    storage = torch.finfo(torch.float32).eps * mean.abs()
    mean_err = (((got_mean - mean).abs() - storage).clamp_min(0) / std).max().item()
    var_err = ((got_var - var).abs() / var.clamp_min(1e-30)).max().item()
    return mean_err, var_err


def reference_metrics(before: torch.Tensor, after: torch.Tensor, labels: torch.Tensor | None) -> dict[str, float]:
    """Top-1/top-5/cross-entropy and prediction change/KL written out from their definitions."""
    p_before = before.double().softmax(1)
    p_after = after.double().softmax(1)
    kl = (p_before * (p_before.log() - p_after.log())).sum(1).mean().item()
    changed = (before.argmax(1) != after.argmax(1)).double().mean().item()
    result = {"kl": kl, "changed": changed}
    if labels is not None:
        for name, logits in (("before", before), ("after", after)):
            order = logits.double().argsort(1, descending=True)
            result[f"top1_{name}"] = (order[:, 0] == labels).double().mean().item()
            result[f"top5_{name}"] = (order[:, :5] == labels[:, None]).any(1).double().mean().item()
            picked = logits.double().log_softmax(1).gather(1, labels[:, None])
            result[f"ce_{name}"] = -picked.mean().item()
    return result

def assert_metrics_match(
    metrics: Any, expected: dict[str, float], *, cross_entropy_rel: float, kl_rel: float
) -> None:
    """The engine's labelled evaluation metrics (the ranks' ``EvalMetrics`` or the report's
    ``evaluation`` section: read by attribute alike) equal :func:`reference_metrics`: counts
    exactly, the float sums within the given relative tolerances."""
    for name in ("before", "after"):
        scores = getattr(metrics, name)
        assert scores.top1 == pytest.approx(expected[f"top1_{name}"], abs=1e-12)
        assert scores.top5 == pytest.approx(expected[f"top5_{name}"], abs=1e-12)
        assert scores.cross_entropy == pytest.approx(expected[f"ce_{name}"], rel=cross_entropy_rel)
    assert metrics.prediction_change == pytest.approx(expected["changed"], abs=1e-12)
    assert metrics.kl_divergence == pytest.approx(expected["kl"], rel=kl_rel)
