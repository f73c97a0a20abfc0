"""One recalibration, end to end: the function the CLI and the job runner both call.

It validates everything it can on the driver first (architecture and checkpoint, or
program; data; that the model accepts the data) so bad input fails in seconds with a
clear error, then runs the ranks on Ray and writes the statistics back into the model's
own BN buffers, from where they go into the checkpoint in its uploaded format and layout,
or into the same program archive.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field, StrictInt, field_validator, model_validator
from torch import nn

from bnrecal.workers.data import DatasetSpec, describe_dataset, detect_format, discard_unpack, read_labels, ship_dataset
from bnrecal.workers.data.objectstore import is_data_uri
from bnrecal.workers.engine.batchnorm import BatchNormLayer, SkippedLayer, find_batchnorm_layers
from bnrecal.workers.engine.calibration import StopRule, apply_statistics
from bnrecal.workers.engine.calibrator import probe_call_order
from bnrecal.workers.engine.evaluation import check_eval_output
from bnrecal.workers.engine.moments import MomentStats
from bnrecal.errors import CancelledError, DatasetError, NoBatchNormError, RunError
from bnrecal.workers.models.checkpoints import Checkpoint
from bnrecal.workers.ranks.collectives import backend_for_device
from bnrecal.workers.ranks.local import IN_PROCESS, run_in_process
from bnrecal.workers.ranks.plan import EvalPlan, GroupOptions, RankPlan
from bnrecal.workers.ranks.sharding import rank_ranges

from bnrecal.service.run.model_source import LoadedModel, load_model
from bnrecal.service.run.options import STARTING_PHASE, RunOptions, check_model_choice
from bnrecal.service.run.report import build_report, write_report
from bnrecal.service.settings import Settings

if TYPE_CHECKING:  # Ray is imported where a run uses it: a one-worker run in this process never does
    from bnrecal.workers.ranks.pool import WarmPool

ProgressCallback = Callable[[int, int, str], None]
"""Called with (samples done, samples total, phase) as the ranks report progress; the
phase is ``calibrating``, then ``evaluating`` when the request evaluates."""


class RecalibrationRequest(RunOptions):
    """The run options, with the checkpoint (or program) and data as local paths: what
    ``recalibrate`` takes. A program replaces ``arch``, ``model_kwargs`` and ``checkpoint``.

    With ``eval_data`` the model is evaluated before and after on it (report ``evaluation``).
    The ``*_name`` fields are what messages and the report call each file instead of its
    own name: the service stores uploads under their digest and passes the names they
    were uploaded with (only shown, never used as paths).
    """

    checkpoint: Path | None = None
    program: Path | None = None
    data: Path | str
    eval_data: Path | str | None = None
    eval_max_samples: StrictInt | None = Field(default=None, ge=1, le=2**53)
    checkpoint_name: str | None = None
    program_name: str | None = None
    data_name: str | None = None
    eval_data_name: str | None = None

    @field_validator("data", "eval_data", mode="before")
    @classmethod
    def _path_unless_uri(cls, value: object) -> object:
        """Data is a local path, or kept as written when it is a URI (``s3://...``)."""
        if isinstance(value, str) and not is_data_uri(value):
            return Path(value)
        return value

    @model_validator(mode="after")
    def _one_model(self) -> RecalibrationRequest:
        """An architecture with a checkpoint, or a program: exactly one model."""
        check_model_choice(self.arch, self.checkpoint, self.program, self.model_kwargs)
        return self


@dataclass
class Recalibration:
    """A finished recalibration: the updated model, its buffer updates and the report."""

    model: nn.Module
    loaded: LoadedModel
    updates: dict[str, torch.Tensor]
    dataset: DatasetSpec
    report: dict[str, Any]
    stale_buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The checkpoint as uploaded (None for a program)."""
        return self.loaded.checkpoint

    def save_model(self, path: str | os.PathLike[str]) -> None:
        """Write the recalibrated checkpoint in the uploaded format and layout, or the
        recalibrated program (the same archive with new running buffers)."""
        self.loaded.save(self.updates, path)

    def save_report(self, path: str | os.PathLike[str]) -> None:
        """Write ``report.json``."""
        write_report(self.report, path)

    def stale_model(self) -> nn.Module:
        """A copy of the model with its BN statistics as they were before the recalibration
        (to show what recalibrating bought, e.g. in INT8)."""
        import copy

        stale = copy.deepcopy(self.model)
        state = stale.state_dict()
        for key, value in self.stale_buffers.items():
            state[key].copy_(value)
        return stale

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
    pool: WarmPool | None = None,
    in_process: bool = False,
) -> Recalibration:
    """Recompute every BN layer's running statistics of a checkpoint (or program) on Ray actors.

    With a ``pool`` (the server's), the ranks are warm actors of an earlier job of the
    same shape when there are some, and stay warm for the next one. With ``in_process``
    (``bnrecal calibrate --workers 1`` without a Ray address) the one rank runs in this
    process, without Ray (``workers.ranks.local``): the same pass, the same statistics.
    """
    loaded = load_model(
        settings, arch=request.arch, model_kwargs=request.model_kwargs, checkpoint=request.checkpoint,
        checkpoint_name=request.checkpoint_name, program=request.program, program_name=request.program_name,
    )
    model = loaded.model
    layers, skipped = find_batchnorm_layers(model)
    if not layers:
        detail = f" ({len(skipped)} without running statistics)" if skipped else ""
        raise NoBatchNormError(f"{loaded.label} has no BatchNorm layer to recalibrate{detail}")
    dataset = describe_dataset(
        request.data,
        transform=request.transform,
        max_samples=request.sample_limit,
        **settings.unpack_options(),
        name=request.data_name,
        endpoint_url=settings.s3_endpoint_url,
        order=request.order,
        seed=request.seed,
    )
    try:
        with dataset.open() as data:
            call_order = probe_call_order(model, layers, data.load(0, 1))
    except DatasetError as exc:
        dataset.name_in(exc)
        raise
    evaluation = _plan_evaluation(request, model, settings) if request.eval_data is not None else None
    old = [(layer.running_mean.clone(), layer.running_var.clone()) for layer in layers]
    stale_buffers = {key: value.clone() for key, value in bn_buffer_updates(layers).items()}

    if in_process and request.workers != 1:
        raise ValueError("a run in the calling process has one worker")
    started_local = False
    if in_process:
        cpus, backend = float(torch.get_num_threads()), IN_PROCESS
    else:
        from bnrecal.service.run.cluster import ensure_ray

        started_local = ensure_ray(settings.ray_address, min_cpus=request.workers)
        cpus, _ = rank_resources(settings, request)
        backend = backend_for_device(request.device)
    plan = RankPlan(
        model=loaded.source,
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
        evaluation=evaluation,
        stop=StopRule(request.stop_tolerance) if request.auto_samples else None,
    )
    options = group_options(settings, request.workers, request.device, request.placement, cpus=cpus)
    totals = {"calibrating": dataset.num_samples}
    if evaluation is not None:
        totals["evaluating"] = evaluation.dataset.num_samples

    seen = dict.fromkeys(totals, 0)

    def progress(phase: str, done: int) -> None:
        # A rank may start evaluating while a peer's last calibration steps are still on
        # their way: the phases are reported in order, calibration to its end first.
        seen[phase] = done
        calibrated = seen["calibrating"] >= totals["calibrating"] or (request.auto_samples and phase == "evaluating")
        if on_progress is None or (phase == "evaluating" and not calibrated):
            return
        on_progress(done, totals[phase], phase)
        if phase == "calibrating" and calibrated and seen.get("evaluating"):
            on_progress(seen["evaluating"], totals["evaluating"], "evaluating")

    transport = IN_PROCESS if in_process else resolve_data_transport(settings.data_transport)
    shards = eval_shards = None
    if transport == "object_store":  # data in object storage is fetched by each rank itself
        shards = ship_rank_shards(dataset, request.batch_size, request.workers) if dataset.remote is None else None
        if evaluation is not None and evaluation.dataset.remote is None:
            eval_shards = ship_rank_shards(evaluation.dataset, evaluation.batch_size, request.workers)
    retries = settings.max_retries if request.max_retries is None else request.max_retries
    failures: list[str] = []
    while True:
        seen.update(dict.fromkeys(totals, 0))
        if on_progress is not None:  # the samples to calibrate are known before any worker starts
            on_progress(0, totals["calibrating"], STARTING_PHASE)
        try:
            if in_process:  # the one rank calibrates the driver's own model: nothing to ship
                result = run_in_process(plan, model, on_progress=progress, cancel=cancel)
                break
            from bnrecal.workers.ranks.group import run_rank_group

            result = run_rank_group(
                plan, loaded.weights, options, on_progress=progress, cancel=cancel,
                shards=shards, eval_shards=eval_shards, pool=pool,
            )
            break
        except CancelledError:
            raise
        except DatasetError as exc:
            # The content of an archive is bad (an image that does not decode): keep nothing of it.
            for spec in (dataset, evaluation.dataset if evaluation is not None else None):
                if spec is not None and spec.kind == "images" and spec.path != spec.source:
                    discard_unpack(spec.path)
                if spec is not None:
                    spec.name_in(exc)
            raise
        except RunError as exc:
            if len(failures) >= retries:
                if failures:
                    exc.message = f"{exc.message} (after {len(failures)} retries)"
                    exc.args = (exc.message,)
                raise
            failures.append(exc.message)
    stats = [MomentStats(s["count"], s["mean"], s["var"], s.get("se_mean"), s.get("se_var")) for s in result.stats]
    unreached = apply_statistics(layers, stats, result.steps)
    skipped = skipped + [SkippedLayer(name, "not called by the forward pass") for name in unreached]
    calibrated = [layer for layer in layers if layer.name not in set(unreached)]
    report = build_report(
        request,
        result,
        [(layer, *old[i], result.calls[i], stats[i]) for i, layer in enumerate(layers) if layer in calibrated],
        skipped,
        run={
            "backend": backend,
            "placement": IN_PROCESS if in_process else options.placement_strategy,
            "data_transport": "remote" if dataset.remote is not None else transport,
            "object_store_bytes": sum(shard.nbytes for shard in [*(shards or []), *(eval_shards or [])]),
            "attempts": len(failures) + 1,
            "retried_failures": failures,
            "cpus_per_worker": cpus,
            "dataset": dataset,
            "embedded_cluster": started_local or (not in_process and _is_local_instance()),
        },
    )
    if evaluation is not None and result.evaluation is not None:
        report["evaluation"] = {"data": evaluation.dataset.summary(), **result.evaluation, "collectives": 1}
    if loaded.is_program:
        report["program"] = {"name": loaded.source.name, "batch": model.batch.describe()}  # type: ignore[union-attr]
    return Recalibration(model, loaded, bn_buffer_updates(calibrated), dataset, report, stale_buffers)


def _plan_evaluation(request: RecalibrationRequest, model: nn.Module, settings: Settings) -> EvalPlan:
    """Describe the evaluation data, read its labels and check on one sample, on the driver,
    that the model's output can be evaluated: a problem fails here, before any actor starts."""
    assert request.eval_data is not None
    source = request.eval_data
    # The transform is for images: evaluation arrays beside calibration images are fed as they are.
    if isinstance(source, str):  # object storage: arrays by their extension
        arrays = source.lower().endswith((".npy", ".npz"))
    else:
        arrays = source.is_file() and detect_format(source, "evaluation data", request.eval_data_name) in ("npy", "npz")
    dataset = describe_dataset(
        source,
        transform=None if arrays else request.transform,
        max_samples=request.eval_max_samples,
        **settings.unpack_options(),
        role="evaluation data",
        name=request.eval_data_name,
        endpoint_url=settings.s3_endpoint_url,
    )
    try:
        labels = read_labels(dataset)
        with dataset.open() as data:
            target = check_eval_output(model, data.load(0, 1), labels)
    except DatasetError as exc:
        dataset.name_in(exc)
        raise
    return EvalPlan(dataset=dataset, labels=labels, target=target, batch_size=request.batch_size)


plan_evaluation = _plan_evaluation
"""The evaluation data described and checked on the driver (also for the INT8 export's accuracy)."""


def ship_rank_shards(dataset: DatasetSpec, batch_size: int, workers: int) -> list[Any]:
    """Each rank's samples of ``dataset``, put in the object store."""
    ranges = [rank_ranges(dataset.num_samples, batch_size, workers, r) for r in range(workers)]
    return ship_dataset(dataset, ranges)


def bn_buffer_updates(layers: list[BatchNormLayer]) -> dict[str, torch.Tensor]:
    """The checkpoint entries a recalibration changes, keyed by model key."""
    updates: dict[str, torch.Tensor] = {}
    for layer in layers:
        for role, key in layer.buffer_names().items():
            updates[key] = getattr(layer, role).detach().cpu()
    return updates


def _is_local_instance() -> bool:
    from bnrecal.service.run.cluster import is_local_instance

    return is_local_instance()


def resolve_data_transport(setting: str) -> str:
    """Resolve ``auto``: share paths only on a single-node cluster this process is part of."""
    if setting != "auto":
        return setting
    import ray

    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    here = ray.get_runtime_context().get_node_id()
    return "shared" if alive == [here] else "object_store"


def rank_resources(settings: Settings, options: RunOptions) -> tuple[float, float]:
    """CPUs and GPUs each rank of a job asks Ray for (the runner counts them the same way)."""
    gpus = settings.gpus_per_worker if options.device == "cuda" else 0.0
    return cpus_per_worker(settings, options.workers), gpus


def group_options(
    settings: Settings, workers: int, device: str, placement: str | None = None, *, cpus: float | None = None
) -> GroupOptions:
    """How a job's ``workers`` ranks are placed and timed, from the settings: CPUs (``cpus``
    when already decided) and GPUs per rank, the placement strategy (``placement`` over the
    setting) and the timeouts; the same for the calibration's ranks and the INT8 range pass's."""
    return GroupOptions(
        cpus_per_worker=cpus_per_worker(settings, workers) if cpus is None else cpus,
        gpus_per_worker=settings.gpus_per_worker if device == "cuda" else 0.0,
        placement_strategy=(placement or settings.placement_strategy).upper(),
        collective_timeout_s=settings.collective_timeout_s,
        placement_timeout_s=settings.placement_timeout_s,
    )


def cpus_per_worker(settings: Settings, workers: int) -> float:
    """CPUs (and torch threads) each rank asks for: the setting, else the local CPUs split
    between the ranks on a single-node cluster, else one."""
    import ray

    from bnrecal.service.run.cluster import is_local_instance

    if settings.cpus_per_worker:
        return settings.cpus_per_worker
    if ray.is_initialized() and not is_local_instance():
        return 1.0
    return float(max(1, (os.cpu_count() or 1) // workers))

