"""One recalibration, end to end: the function the CLI and the job runner both call.

It validates everything it can on the driver first (architecture, checkpoint, data,
that the model accepts the data) so bad input fails in seconds with a clear error,
then runs the ranks on Ray and writes the statistics back into the model's own BN
modules, from where they go into the checkpoint in its uploaded format and layout.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from torch import nn

from workers.batchnorm import MODES, BatchNormLayer, SkippedLayer, find_batchnorm_layers
from workers.calibrator import probe_call_order
from workers.calibration import apply_statistics
from workers.checkpoints import Checkpoint, load_checkpoint, load_into_model, save_checkpoint
from workers.collectives import backend_for_device
from workers.data import DatasetSpec, describe_dataset
from workers.data import ship_dataset
from workers.errors import CancelledError, NoBatchNormError, RunError, SpecError
from workers.group import GroupOptions, run_rank_group
from workers.models import build_model
from workers.moments import MomentStats
from workers.plan import RankPlan
from workers.sharding import rank_ranges

from .cluster import ensure_ray, is_local_instance
from .report import layer_entry, skipped_entries, write_report
from .settings import Settings

PLACEMENTS = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")

ProgressCallback = Callable[[int, int], None]
"""Called with (samples done, samples total) as the ranks report progress."""


@dataclass
class RecalibrationRequest:
    """What to recalibrate and how (the calibrate flags / the job spec)."""

    arch: str
    checkpoint: Path
    data: Path
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    workers: int = 1
    batch_size: int = 32
    mode: str = "sync"
    max_samples: int | None = None
    device: str = "cpu"
    transform: dict[str, Any] | None = None
    placement: str | None = None
    max_retries: int | None = None

    def validate(self) -> None:
        """Refuse impossible options before any work starts, naming the option."""
        if self.workers < 1:
            raise SpecError(f"workers must be >= 1, got {self.workers}", field="workers")
        if self.batch_size < 1:
            raise SpecError(f"batch_size must be >= 1, got {self.batch_size}", field="batch_size")
        if self.mode not in MODES:
            raise SpecError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}", field="mode")
        if self.device not in ("cpu", "cuda"):
            raise SpecError(f"device must be cpu or cuda, got {self.device!r}", field="device")
        if self.max_samples is not None and self.max_samples < 1:
            raise SpecError(f"max_samples must be >= 1, got {self.max_samples}", field="max_samples")
        if self.placement is not None and self.placement.upper() not in PLACEMENTS:
            raise SpecError(f"placement must be one of {', '.join(p.lower() for p in PLACEMENTS)}", field="placement")
        if self.max_retries is not None and self.max_retries < 0:
            raise SpecError(f"max_retries must be >= 0, got {self.max_retries}", field="max_retries")
        if not isinstance(self.model_kwargs, dict):
            raise SpecError("model_kwargs must be a JSON object", field="model_kwargs")


@dataclass
class Recalibration:
    """A finished recalibration: the updated model, its checkpoint updates and the report."""

    model: nn.Module
    checkpoint: Checkpoint
    updates: dict[str, torch.Tensor]
    dataset: DatasetSpec
    report: dict[str, Any]

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write the recalibrated checkpoint in the uploaded format and layout."""
        save_checkpoint(self.checkpoint, self.updates, path)

    def save_report(self, path: str | os.PathLike[str]) -> None:
        """Write ``report.json``."""
        write_report(self.report, path)

    def calibration_samples(self, count: int) -> torch.Tensor:
        """The first ``count`` calibration samples, e.g. to verify an export."""
        with self.dataset.open() as data:
            return data.load(0, min(count, self.dataset.num_samples))


def recalibrate(
    request: RecalibrationRequest,
    settings: Settings,
    *,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> Recalibration:
    """Recompute every BN layer's running statistics of a checkpoint on Ray actors."""
    request.validate()
    model = build_model(request.arch, request.model_kwargs, allowed_modules=tuple(settings.model_modules))
    checkpoint = load_checkpoint(request.checkpoint)
    load_into_model(model, checkpoint)
    model.eval()
    layers, skipped = find_batchnorm_layers(model)
    if not layers:
        detail = f" ({len(skipped)} without running statistics)" if skipped else ""
        raise NoBatchNormError(f"{request.arch} has no BatchNorm layer to recalibrate{detail}")
    dataset = describe_dataset(
        request.data,
        transform=request.transform,
        max_samples=request.max_samples,
        unpack_root=Path(settings.data_dir) / "unpacked",
    )
    with dataset.open() as data:
        call_order = probe_call_order(model, layers, data.load(0, min(2, dataset.num_samples)))
    old = [(layer.module.running_mean.clone(), layer.module.running_var.clone()) for layer in layers]

    started_local = ensure_ray(settings.ray_address, min_cpus=request.workers)
    cpus = cpus_per_worker(settings, request.workers)
    backend = backend_for_device(request.device)
    plan = RankPlan(
        arch=request.arch,
        model_kwargs=dict(request.model_kwargs),
        allowed_modules=tuple(settings.model_modules),
        dataset=dataset,
        batch_size=request.batch_size,
        mode=request.mode,
        world_size=request.workers,
        device=request.device,
        backend=backend,
        group_name="",
        layer_names=tuple(layer.name for layer in layers),
        call_order=tuple(call_order),
        loader_workers=0 if dataset.kind == "array" else max(0, int(cpus) - 1),
        memory_format=settings.memory_format,
    )
    options = GroupOptions(
        cpus_per_worker=cpus,
        gpus_per_worker=settings.gpus_per_worker if request.device == "cuda" else 0.0,
        placement_strategy=(request.placement or settings.placement_strategy).upper(),
        collective_timeout_s=settings.collective_timeout_s,
        placement_timeout_s=settings.placement_timeout_s,
    )
    total = dataset.num_samples

    def progress(done: int) -> None:
        if on_progress is not None:
            on_progress(done, total)

    transport = _data_transport(settings.data_transport)
    shards = None
    if transport == "object_store":
        ranges = [rank_ranges(total, request.batch_size, request.workers, r) for r in range(request.workers)]
        shards = ship_dataset(dataset, ranges)
    retries = settings.max_retries if request.max_retries is None else request.max_retries
    failures: list[str] = []
    while True:
        try:
            result = run_rank_group(
                plan, model.state_dict(), options, on_progress=progress, cancel=cancel, shards=shards
            )
            break
        except CancelledError:
            raise
        except RunError as exc:
            if len(failures) >= retries:
                if failures:
                    exc.message = f"{exc.message} (after {len(failures)} retries)"
                    exc.args = (exc.message,)
                raise
            failures.append(exc.message)
    stats = [MomentStats(s["count"], s["mean"], s["var"]) for s in result.stats]
    unreached = apply_statistics(layers, stats, result.steps)
    skipped = skipped + [SkippedLayer(name, "not called by the forward pass") for name in unreached]
    calibrated = [layer for layer in layers if layer.name not in set(unreached)]
    report = {
        "arch": request.arch,
        "mode": request.mode,
        "world_size": request.workers,
        "backend": backend,
        "device": request.device,
        "batch_size": request.batch_size,
        "samples": result.samples,
        "steps": result.steps,
        "collectives": result.collectives[0],
        "collectives_per_rank": result.collectives,
        "seconds": round(result.seconds, 6),
        "samples_per_second": round(result.samples / result.seconds, 3) if result.seconds > 0 else None,
        "nodes": result.nodes,
        "memory_formats": result.memory_formats,
        "placement": options.placement_strategy,
        "data_transport": transport,
        "attempts": len(failures) + 1,
        "retried_failures": failures,
        "cpus_per_worker": cpus,
        "dataset": {"kind": dataset.kind, "samples": dataset.num_samples, "sample_shape": list(dataset.sample_shape)},
        "layers": [
            layer_entry(layer, *old[i], result.calls[i]) for i, layer in enumerate(layers) if layer in calibrated
        ],
        "skipped": skipped_entries(skipped),
        "embedded_cluster": started_local or is_local_instance(),
    }
    return Recalibration(model, checkpoint, _updates(calibrated), dataset, report)


def _updates(layers: list[BatchNormLayer]) -> dict[str, torch.Tensor]:
    """The checkpoint entries a recalibration changes, keyed by model key."""
    updates: dict[str, torch.Tensor] = {}
    for layer in layers:
        module = layer.module
        updates[f"{layer.name}.running_mean"] = module.running_mean.detach().cpu()
        updates[f"{layer.name}.running_var"] = module.running_var.detach().cpu()
        if module.num_batches_tracked is not None:
            updates[f"{layer.name}.num_batches_tracked"] = module.num_batches_tracked.detach().cpu()
    return updates


def _data_transport(setting: str) -> str:
    """Resolve ``auto``: share paths only on a single-node cluster this process is part of."""
    if setting != "auto":
        return setting
    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    here = ray.get_runtime_context().get_node_id()
    return "shared" if alive == [here] else "object_store"


def cpus_per_worker(settings: Settings, workers: int) -> float:
    """CPUs (and torch threads) each rank asks for: the setting, else the local CPUs split
    between the ranks on a single-node cluster, else one."""
    if settings.cpus_per_worker:
        return settings.cpus_per_worker
    if ray.is_initialized() and not is_local_instance():
        return 1.0
    return float(max(1, (os.cpu_count() or 1) // workers))

