"""``bnrecal.recalibrate``: recalibrate a caller's live model on Ray, in place.

The driver describes the data, decides how the model travels (``model.py``), checks on
one batch that the model takes the data (the same probe as the CLI's), then runs the
same rank group as every recalibration (``workers.ranks.group``) and writes the statistics
into the model's own BN buffers, as ``torch.optim.swa_utils.update_bn`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from workers.data import DatasetSpec
from workers.data.loader import LoaderSpec, model_input
from workers.engine.batchnorm import SkippedLayer, find_batchnorm_layers
from workers.engine.calibration import StopRule, apply_statistics
from workers.engine.calibrator import probe_call_order
from workers.engine.moments import MomentStats
from workers.errors import NoBatchNormError, SpecError, first_line
from workers.ranks.collectives import backend_for_device
from workers.ranks.group import GroupOptions, run_rank_group
from workers.ranks.plan import RankPlan
from workers.ranks.pool import WarmPool

from service.run.cluster import ensure_ray, is_local_instance, shutdown_embedded
from service.run.options import STARTING_PHASE, RunOptions, default
from service.run.progress import progress_bar
from service.run.recalibrate import bn_buffer_updates, cpus_per_worker, resolve_data_transport, ship_rank_shards
from service.run.report import build_report

from ..settings import Settings
from .data import PROBE_SAMPLES, describe_python_data, first_batch
from .model import ShippedModel, ship_model
from .report import RecalibrationReport

Forward = Callable[[nn.Module, Any], Any]


def recalibrate(
    model: nn.Module | torch.export.ExportedProgram,
    data: Any,
    *,
    workers: int = 1,
    mode: str = "sync",
    batch_size: int | None = None,
    max_samples: int | str | None = None,
    device: str = "cpu",
    forward: Forward | None = None,
    ray_address: str | None = None,
    server: str | None = None,
    api_key: str | None = None,
    progress: bool = True,
    pool: WarmPool | None = None,
    settings: Settings | None = None,
    tolerance: float | None = None,
    order: str = "shuffled",
    seed: int = 0,
) -> RecalibrationReport:
    """Recompute every BatchNorm layer's running statistics of ``model`` in place, like
    ``torch.optim.swa_utils.update_bn(loader, model)``, and return the report.

    ``running_mean`` becomes the mean and ``running_var`` the unbiased variance of every
    value each BN layer sees over the whole data (exact population statistics, not an
    average of batch statistics); ``num_batches_tracked`` grows by the number of steps.
    Every other tensor is unchanged; every other module runs in eval mode (dropout off).

    data: a ``DataLoader`` (its batches are the global steps; over a map-style dataset
        each rank decodes only its part of each step with its own DataLoader, so the
        dataset must pickle; an iterable-style one is read on the driver), a map-style
        ``Dataset`` (or a tensor of samples) with ``batch_size``, any other iterable of
        batches (read on the driver and sent to the ranks), or a path or ``s3://`` URI
        (what ``bnrecal calibrate --data`` takes; ``batch_size`` defaults to 32).
        A batch is a tensor, or a tuple or list whose first element is the input;
        anything else (a dict...) needs ``forward``.
    workers: Ray actors (ranks) K; each takes its ``numpy.array_split`` part of every step.
    mode: ``sync`` (statistics of the whole global batch, SyncBN semantics; the result
        does not depend on K) or ``local`` (each rank's own slice).
    max_samples: use only the first M samples, or ``"auto"``: stop once every layer's
        standard errors are below ``tolerance`` (default 0.05; sync mode only).
    order, seed: the order a path's samples are read in (``shuffled`` with ``seed``, or
        ``given``); data in memory keeps its own order, as with ``update_bn``.
    device: where the ranks compute (``cpu`` or ``cuda``).
    forward: ``forward(model, batch)`` feeds the model a batch (e.g. ``model(**batch)``);
        with it the model travels pickled (see below), never as a program.
    ray_address: the Ray cluster to run on (else ``RAY_ADDRESS``, else an embedded local
        instance, shut down again after the call; a cluster the caller joined stays).
    server, api_key: run as a job of the bnrecal server at this URL instead: the model
        goes as a program (it must export), the data as ``.npy`` (see ``docs/python.md``).
    progress: a progress bar on a terminal; ``False`` for none.
    pool: warm rank actors (``workers.ranks.pool.WarmPool``) reused across calls.

    The model reaches the ranks as a ``torch.export`` program when it exports (traced on
    one batch; no code needed on the nodes), else pickled with its class by reference:
    its code must then be importable on every node (a class defined in ``__main__``
    travels by value). Errors are ``bnrecal.BnrecalError`` subclasses with one-line messages.
    """
    settings = settings or Settings()
    options = RunOptions.checked(
        workers=_count(workers, "workers"), mode=mode, device=device,
        batch_size=_count(batch_size, "batch_size") if batch_size is not None else default("batch_size"),
        max_samples="auto" if max_samples == "auto" else None, tolerance=tolerance, order=order, seed=seed,
    )
    if isinstance(model, nn.Module) and not find_batchnorm_layers(model)[0]:  # before any export
        raise _no_batchnorm(model, find_batchnorm_layers(model)[1])
    if server is not None:
        from .remote import recalibrate_on_server

        return recalibrate_on_server(
            model, data, server=server, api_key=api_key, options=options, max_samples=max_samples,
            batch_size=batch_size, forward=forward, progress=lambda: _bar(progress, "queued"),
        )
    spec = describe_python_data(
        data, batch_size=batch_size, max_samples=max_samples, select_input=forward is None, settings=settings,
        order=options.order, seed=options.seed,
    )
    sample = _probe_batch(spec, forward)
    shipped = ship_model(model, sample, forward)
    layers, skipped = find_batchnorm_layers(shipped.driver)
    if not layers:
        raise _no_batchnorm(model, skipped)
    call_order = probe_call_order(shipped.driver, layers, sample, forward)
    old = [(layer.running_mean.clone(), layer.running_var.clone()) for layer in layers]
    if isinstance(spec, LoaderSpec):
        options = options.model_copy(update={"batch_size": max(spec.sizes)})

    started_local = ensure_ray(ray_address, min_cpus=options.workers)
    try:
        result, run = _run(shipped, spec, options, layers, call_order, settings, forward, progress, pool)
        run["embedded_cluster"] = started_local or is_local_instance()
    finally:
        if started_local:
            shutdown_embedded()
    stats = [MomentStats(s["count"], s["mean"], s["var"], s.get("se_mean"), s.get("se_var")) for s in result.stats]
    unreached = apply_statistics(layers, stats, result.steps)
    calibrated = [layer for layer in layers if layer.name not in set(unreached)]
    if shipped.write_back is not None:
        shipped.write_back(bn_buffer_updates(calibrated))
    skipped = skipped + [SkippedLayer(name, "not called by the forward pass") for name in unreached]
    report = build_report(
        options, result,
        [(layer, *old[i], result.calls[i], stats[i]) for i, layer in enumerate(layers) if layer in calibrated],
        skipped, run,
    )
    report["model"] = shipped.describe()
    report["data"] = spec.summary()
    return RecalibrationReport(report)


def _run(
    shipped: ShippedModel, spec: DatasetSpec | LoaderSpec, options: RunOptions, layers: list[Any],
    call_order: list[int], settings: Settings, forward: Forward | None, progress: bool, pool: WarmPool | None,
) -> tuple[Any, dict[str, Any]]:
    """Run the ranks (Ray is up); the result and the report's run facts."""
    cpus = cpus_per_worker(settings, options.workers)
    gpus = settings.gpus_per_worker if options.device == "cuda" else 0.0
    backend = backend_for_device(options.device)
    plan = RankPlan(
        model=shipped.source, dataset=spec, batch_size=options.batch_size, mode=options.mode,
        world_size=options.workers, device=options.device, backend=backend, group_name="",
        layer_names=tuple(layer.name for layer in layers), call_order=tuple(call_order),
        loader_workers=0 if spec.kind in ("array", "loader", "batches") else max(0, int(cpus) - 1),
        memory_format=settings.memory_format, feed=forward,
        stop=StopRule(options.stop_tolerance) if options.auto_samples else None,
    )
    group = GroupOptions(
        cpus_per_worker=cpus, gpus_per_worker=gpus, placement_strategy=settings.placement_strategy.upper(),
        collective_timeout_s=settings.collective_timeout_s, placement_timeout_s=settings.placement_timeout_s,
    )
    transport, shards = "python", None
    if isinstance(spec, DatasetSpec):
        transport = "remote" if spec.remote is not None else resolve_data_transport(settings.data_transport)
        if transport == "object_store":
            shards = ship_rank_shards(spec, options.batch_size, options.workers)
    total = spec.num_samples
    with _bar(progress) as update:
        try:
            result = run_rank_group(
                plan, shipped.weights, group, shards=shards, pool=pool,
                on_progress=lambda phase, done: update(done, total, phase),
            )
        except TypeError as exc:  # Ray could not pickle the model or the data for the ranks
            if "serialize" not in str(exc):
                raise
            raise _not_picklable(shipped, spec, forward, exc) from None
    run = {
        "backend": backend, "placement": group.placement_strategy, "data_transport": transport,
        "object_store_bytes": sum(shard.nbytes for shard in shards or []), "attempts": 1, "retried_failures": [],
        "cpus_per_worker": cpus, "dataset": spec,
    }
    return result, run


def _no_batchnorm(model: Any, skipped: list[SkippedLayer]) -> NoBatchNormError:
    detail = f" ({len(skipped)} without running statistics)" if skipped else ""
    return NoBatchNormError(f"model {type(model).__name__} has no BatchNorm layer to recalibrate{detail}")


def _not_picklable(
    shipped: ShippedModel, spec: DatasetSpec | LoaderSpec, forward: Forward | None, exc: TypeError
) -> SpecError:
    """Which of what goes to the ranks cannot be pickled, named in one line."""
    from ray import cloudpickle

    parts: list[tuple[str, Any]] = [("model", shipped.weights), ("forward", forward)]
    if isinstance(spec, LoaderSpec):
        parts += [("data", spec.dataset), ("data", spec.collate_fn), ("data", spec.batches)]
    for name, value in parts:
        try:
            cloudpickle.dumps(value)
        except Exception as problem:  # noqa: BLE001 - any pickling failure is the answer
            what = {"model": "the model", "forward": "forward", "data": "the dataset (or its collate_fn)"}[name]
            return SpecError(
                f"{what} cannot be sent to the Ray workers: {type(problem).__name__}: {first_line(problem)} "
                "(it must pickle: see docs/python.md)",
                field=name,
            )
    return SpecError(f"what goes to the Ray workers cannot be pickled: {first_line(exc)}", field="data")


def _bar(progress: bool, first_phase: str = STARTING_PHASE) -> Any:
    """The CLI's progress bar (a terminal only), or none at all."""
    if progress:
        return progress_bar(first_phase)
    from contextlib import nullcontext

    return nullcontext(lambda done, total, phase="": None)


def _probe_batch(spec: DatasetSpec | LoaderSpec, forward: Forward | None) -> Any:
    """A batch of the first samples as the ranks will feed it (the model's input as float32,
    or the batch ``forward`` takes): for the probe and the export."""
    if isinstance(spec, DatasetSpec):
        with spec.open() as opened:
            return opened.load(0, min(PROBE_SAMPLES, spec.num_samples))
    batch = first_batch(spec)
    if forward is not None:
        return batch
    return model_input(batch).to(torch.float32)


def _count(value: Any, name: str) -> int:
    """An integer option as a Python int (numpy integers too), refused when it is not one."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise SpecError(f"{name} must be an integer, got {value!r}", field=name)
    return int(value.__index__())

