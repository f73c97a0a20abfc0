"""The run report (contract section 5): what was done, where, how fast, and per layer."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workers.engine.batchnorm import BatchNormLayer, SkippedLayer
from workers.files import atomic_write

from service.run.options import RunOptions

if TYPE_CHECKING:  # annotations only: writing a report (bnrecal export) needs neither Ray nor the data readers
    from workers.data import DatasetSpec
    from workers.ranks.group import GroupResult

LayerDrift = tuple[BatchNormLayer, torch.Tensor, torch.Tensor, int]
"""A calibrated layer with its old running mean and variance and its call count."""


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
    return {
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
        "layers": [layer_entry(*drift) for drift in layers],
        "skipped": skipped_entries(skipped),
        "embedded_cluster": run["embedded_cluster"],
    }


def layer_entry(
    layer: BatchNormLayer, old_mean: torch.Tensor, old_var: torch.Tensor, calls: int
) -> dict[str, Any]:
    """How far one layer's statistics moved: the report's per-layer entry.

    ``mean_shift`` is the largest channel's mean change in units of its old standard
    deviation; ``var_ratio_max`` and ``var_ratio_min`` the largest and smallest new/old
    variance ratio over channels (null where an old variance was zero), so a channel that
    shrank is visible beside one that grew.
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
    }


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
