"""The run report (contract section 5): what was done, where, how fast, and per layer."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bnrecal.workers.engine.batchnorm import BatchNormLayer, SkippedLayer
from bnrecal.workers.files import atomic_write

from bnrecal.service.run.options import AUTO, RunOptions

if TYPE_CHECKING:  # annotations only: writing a report (bnrecal export) needs neither Ray nor the data readers
    from bnrecal.workers.data import DatasetSpec
    from bnrecal.workers.engine.moments import MomentStats
    from bnrecal.workers.ranks.group import GroupResult

LayerDrift = tuple[BatchNormLayer, torch.Tensor, torch.Tensor, int] | tuple[
    BatchNormLayer, torch.Tensor, torch.Tensor, int, "MomentStats"
]
"""A calibrated layer with its old running mean and variance and its call count, and its
new statistics when they carry standard errors."""


def build_report(
    options: RunOptions,
    result: GroupResult,
    layers: Sequence[LayerDrift],
    skipped: Sequence[SkippedLayer],
    run: dict[str, Any],
) -> dict[str, Any]:
    """The run report (see docs/report.md): the options, what the ranks did, and per layer
    how far its statistics moved. ``run`` holds the facts only the run knows (backend,
    placement, transport, attempts, resources, the dataset, whether Ray was embedded)."""
    dataset: DatasetSpec = run["dataset"]
    entries = [layer_entry(*drift) for drift in layers]
    report = {
        "arch": options.arch,
        "mode": options.mode,
        "world_size": options.workers,
        "backend": run["backend"],
        "device": options.device,
        "batch_size": options.batch_size,
        "samples": result.samples,
        "steps": result.steps,
        "collectives": result.collectives[0],
        "collectives_per_rank": result.collectives,
        "seconds": round(result.seconds, 6),
        "samples_per_second": round(result.samples / result.seconds, 3) if result.seconds > 0 else None,
        "nodes": result.nodes,
        "memory_formats": result.memory_formats,
        "placement": run["placement"],
        "data_transport": run["data_transport"],
        "object_store_bytes": run.get("object_store_bytes", 0),
        "attempts": run["attempts"],
        "retried_failures": run["retried_failures"],
        "cpus_per_worker": run["cpus_per_worker"],
        "dataset": {"kind": dataset.kind, "samples": dataset.num_samples, "sample_shape": list(dataset.sample_shape)},
        "layers": entries,
        "skipped": skipped_entries(skipped),
        "embedded_cluster": run["embedded_cluster"],
    }
    report.update(sampling_entries(options, dataset, result, entries))
    return report


def sampling_entries(
    options: RunOptions, dataset: Any, result: GroupResult, layers: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """How the samples were drawn (``order``, ``seed``: data in memory keeps its own order,
    ``given``) and, with ``max_samples: "auto"``, where the run stopped (``convergence``)."""
    order = getattr(dataset, "order", "given")
    entries: dict[str, Any] = {"order": order, "seed": getattr(dataset, "seed", 0) if order == "shuffled" else None}
    worst = worst_standard_error(layers)
    entries["standard_error_max"] = worst
    if getattr(options, "max_samples", None) == AUTO:
        reached = result.convergence or {}
        entries["convergence"] = {
            "tolerance": options.stop_tolerance,
            "converged": bool(reached.get("converged")),
            "samples": result.samples,
            "available_samples": dataset.num_samples,
            "steps": result.steps,
            "min_steps": reached.get("min_steps"),
            "worst": worst,
        }
    return entries


def worst_standard_error(layers: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The layer and statistic with the largest standard error (worst channel): ``layer``,
    ``statistic`` (``mean``, std units; ``variance``, relative) and ``error``; None without
    standard errors (fewer than two steps)."""
    worst: dict[str, Any] | None = None
    for entry in layers:
        for statistic, key in (("mean", "se_mean_max"), ("variance", "se_var_max")):
            value = entry.get(key)
            if value is not None and (worst is None or value > worst["error"]):
                worst = {"layer": entry["name"], "statistic": statistic, "error": value}
    return worst


def layer_entry(
    layer: BatchNormLayer, old_mean: torch.Tensor, old_var: torch.Tensor, calls: int, stat: MomentStats | None = None
) -> dict[str, Any]:
    """How far one layer's statistics moved, and how precisely they are known: the report's
    per-layer entry.

    ``mean_shift`` is the largest channel's mean change in units of its old standard
    deviation; ``var_ratio_max`` and ``var_ratio_min`` the largest and smallest new/old
    variance ratio over channels (null where an old variance was zero), so a channel that
    shrank is visible beside one that grew. ``se_mean_max``/``se_mean_median`` (std units)
    and ``se_var_max``/``se_var_median`` (relative) are the standard errors of the new mean
    and variance, worst and median channel, null when not estimated (fewer than two steps).
    """
    new_mean = layer.running_mean.detach().double().cpu()
    new_var = layer.running_var.detach().double().cpu()
    old_mean, old_var = old_mean.double().cpu(), old_var.double().cpu()
    shift = ((new_mean - old_mean).abs() / torch.sqrt(old_var + layer.epsilon)).max().item()
    ratio_max = ratio_min = None
    if bool((old_var > 0).all()):
        ratios = new_var / old_var
        ratio_max, ratio_min = ratios.max().item(), ratios.min().item()
    return {
        "name": layer.name,
        "class": layer.class_name,
        "channels": layer.channels,
        "calls": calls,
        "mean_shift": _finite(shift),
        "var_ratio_max": _finite(ratio_max),
        "var_ratio_min": _finite(ratio_min),
        **standard_error_entries(stat),
    }


def standard_error_entries(stat: MomentStats | None) -> dict[str, float | None]:
    """Worst and median channel of a layer's standard errors (null when not estimated)."""
    entries: dict[str, float | None] = dict.fromkeys(("se_mean_max", "se_mean_median", "se_var_max", "se_var_median"))
    if stat is None or stat.se_mean is None or stat.se_var is None or not stat.se_mean.numel():
        return entries
    for name, values in (("se_mean", stat.se_mean), ("se_var", stat.se_var)):
        values = values.double().cpu()
        entries[f"{name}_max"] = _finite(float(values.max().item()))
        entries[f"{name}_median"] = _finite(float(values.median().item()))
    return entries


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def skipped_entries(skipped: Sequence[SkippedLayer]) -> list[dict[str, str]]:
    """The layers left alone, each with its reason."""
    return [{"name": s.name, "reason": s.reason} for s in skipped]


def write_report(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write the report as indented JSON, atomically."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2, allow_nan=False) + "\n"
    atomic_write(target, lambda temp: temp.write_text(text))
