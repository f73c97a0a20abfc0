"""Where the ranks of a run execute (the run core's executors, ``service.run.core``).

:class:`InProcess` runs the one rank in the calling process, without Ray
(``workers.ranks.process.work``): ``bnrecal calibrate --workers 1`` and ``bnrecal.recalibrate(...,
workers=1)`` without a Ray address. :class:`RayRanks` runs a rank group on Ray
(``workers.ranks.group``), warm from a pool when there is one: it starts or joins Ray,
decides how the data reaches the ranks, and places them by the settings.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from bnrecal.errors import RunError, first_line
from bnrecal.workers.data import DatasetSpec
from bnrecal.workers.data.reading.kept import KeptCounts
from bnrecal.workers.data.formats.loader import LoaderSpec
from bnrecal.workers.ranks.process.work import IN_PROCESS, run_in_process
from bnrecal.workers.ranks.plan import EvalPlan, GroupResult, RankPlan
from bnrecal.workers.ranks.process.scoped import release_scope

from bnrecal.service.run.core import RankSet, RunControl, RunPlan
from bnrecal.service.run.outputs.onnx_passes import RankPasses
from bnrecal.service.run.report.document import Placement
from bnrecal.service.settings import Settings

if TYPE_CHECKING:  # Ray is imported where a run uses it: a run in this process never does
    from bnrecal.workers.ranks.gangs.job_gang import JobGang
    from bnrecal.workers.ranks.gangs.pool import WarmPool


class InProcess:
    """The one rank in the calling process, without Ray: it calibrates the driver's own
    model, so nothing is shipped (``workers.ranks.process.work``)."""

    def start(self, plan: RunPlan) -> None:
        """Nothing to start; a run here has one worker."""
        if plan.options.workers != 1:
            raise ValueError("a run in the calling process has one worker")

    def rank_plan(self, plan: RankPlan) -> RankPlan:
        """Loader processes for decoded data: the threads this process has, less one."""
        return replace(plan, loader_workers=_loader_workers(plan.dataset, float(torch.get_num_threads())))

    def execute(
        self, plan: RankPlan, run: RunPlan, on_progress: Callable[[str, int], None], cancel: threading.Event | None
    ) -> GroupResult:
        """The pass, here."""
        return run_in_process(plan, run.model, on_progress=on_progress, cancel=cancel)

    def placement(self, run: RunPlan) -> Placement:
        """In process, all of it; data in object storage is still fetched from there (``remote``)."""
        remote = isinstance(run.data, DatasetSpec) and run.data.remote is not None
        return Placement(IN_PROCESS, IN_PROCESS, "remote" if remote else IN_PROCESS, float(torch.get_num_threads()), False)

    def ranks(self) -> RankSet | None:
        """None: the phases after the statistics run here, a world of one, as they did."""
        return None

    def release_decoded(self, scope: str) -> KeptCounts:
        """Drop what this process kept for the run (samples, objects); what its passes decoded and reused."""
        return release_scope(scope)

    def close(self) -> None:
        """Nothing was started."""


class ProcessGroupRanks(InProcess):
    """This process as one rank of the caller's own ``torch.distributed`` group (docs/training.md):
    every rank of the group runs the same call in its own process, and each BN call's moments
    are combined over the group (``ProcessGroupCollective``); no Ray, no process of ours.
    ``split``: the data is the same on every rank and each takes its part of every global step
    (a path, a map-style Dataset); else each rank's data is its own (its DataLoader)."""

    def __init__(self, collective: Any, split: bool) -> None:
        self.collective = collective
        self.split = split
        self.gated = False

    def gate(self, error: BaseException | None = None) -> None:
        """Every rank's word before its pass, ``error`` this rank's failure: raises on every
        rank whose own word was good when another rank's was not (its pass would wait for
        that rank's collectives forever)."""
        self.gated = True
        word = None if error is None else f"{type(error).__name__}: {first_line(error)}"
        failed = [(rank, said) for rank, said in enumerate(self.collective.gather(word)) if said is not None]
        if failed and error is None:
            rank, said = failed[0]
            raise RunError(f"rank {rank} of the process group failed before the pass: {said}")

    def rank_plan(self, plan: RankPlan) -> RankPlan:
        """The plan of the group's world where the data is split between its ranks."""
        plan = super().rank_plan(plan)
        return replace(plan, world_size=self.collective.world_size) if self.split else plan

    def execute(
        self, plan: RankPlan, run: RunPlan, on_progress: Callable[[str, int], None], cancel: threading.Event | None
    ) -> GroupResult:
        """This rank's pass, its moments combined over the group, once every rank has said it got there."""
        self.gate()
        return run_in_process(plan, run.model, on_progress=on_progress, cancel=cancel, collective=self.collective,
                              rank=self.collective.rank)

    def placement(self, run: RunPlan) -> Placement:
        """The group's backend; each rank in its own process, reading its own data."""
        return Placement(f"torch.distributed:{self.collective.backend}", "process group", IN_PROCESS,
                         float(torch.get_num_threads()), False)


class RayRanks:
    """A rank group on Ray (``workers.ranks.group``): the cluster at ``address`` (else
    ``RAY_ADDRESS``, else an embedded local instance, shut down again after the run with
    ``stop_embedded``), warm ranks from ``pool`` when it has a gang of the same shape."""

    def __init__(
        self, settings: Settings, *, address: str | None = None, pool: WarmPool | None = None,
        placement: str | None = None, stop_embedded: bool = False,
    ) -> None:
        self.settings = settings
        self.address = address
        self.pool = pool
        self.placement_strategy = placement
        self.stop_embedded = stop_embedded
        self.started_local = False
        self.transport = "python"
        self.shards: list[Any] | None = None
        self.eval_shards: list[Any] | None = None
        self.gang: JobGang | None = None

    def start(self, plan: RunPlan) -> None:
        """Start or join Ray, place nothing yet (once); decide how the plan's data reaches the ranks."""
        from bnrecal.service.run.cluster import ensure_ray

        from bnrecal.workers.ranks.gangs.job_gang import JobGang

        options = self.options = plan.options
        if self.gang is None:  # once: the runs of a sweep start here again, each with its own data
            self.started_local = ensure_ray(self.address, min_cpus=options.workers)
            self.gang = JobGang(self.pool)  # every pass of the run on the same ranks, which keep what they decode
            self.group = group_options(self.settings, options.workers, options.device, self.placement_strategy)
        self.shards = self.eval_shards = None
        if isinstance(plan.data, DatasetSpec):
            self.transport = "remote" if plan.data.remote is not None else resolve_data_transport(self.settings.data_transport)
        if self.transport == "object_store":  # data in object storage is fetched by each rank itself
            if isinstance(plan.data, DatasetSpec) and plan.data.remote is None:
                self.shards = ship_rank_shards(plan.data, options.batch_size, options.workers)
            evaluation = plan.evaluation
            if evaluation is not None and evaluation.dataset.remote is None:
                self.eval_shards = ship_rank_shards(evaluation.dataset, evaluation.batch_size, options.workers)

    def rank_plan(self, plan: RankPlan) -> RankPlan:
        """The collective's backend by device (NCCL on CUDA, GLOO on CPU), and loader processes."""
        from bnrecal.workers.ranks.process.ray_collective import backend_for_device

        return replace(
            plan, backend=backend_for_device(plan.device),
            loader_workers=_loader_workers(plan.dataset, self.group.cpus_per_worker),
        )

    def execute(
        self, plan: RankPlan, run: RunPlan, on_progress: Callable[[str, int], None], cancel: threading.Event | None
    ) -> GroupResult:
        """The pass on the rank group."""
        from bnrecal.workers.ranks.group import run_rank_group

        return run_rank_group(
            plan, run.weights, self.group, on_progress=on_progress, cancel=cancel,
            shards=self.shards, eval_shards=self.eval_shards, pool=self.gang,
        )

    def placement(self, run: RunPlan) -> Placement:
        """The backend, placement strategy, transport and resources the ranks had."""
        from bnrecal.workers.ranks.process.ray_collective import backend_for_device

        from bnrecal.service.run.cluster import is_local_instance

        shipped = [*(self.shards or []), *(self.eval_shards or [])]
        return Placement(
            backend=backend_for_device(run.options.device), placement=self.group.placement_strategy,
            data_transport=self.transport, cpus_per_worker=self.group.cpus_per_worker,
            embedded_cluster=self.started_local or is_local_instance(),
            object_store_bytes=sum(shard.nbytes for shard in shipped),
        )

    def ranks(self) -> RankSet | None:
        """The job's gang with the run's placement, sharding and shipped shards."""
        return RankSet(self.options.workers, self.options.device, self.group, self.shards, self.eval_shards, self.gang)

    def release_decoded(self, scope: str) -> KeptCounts:
        """The run is over: its ranks drop the samples they kept and go back to the pool (or
        are killed); what their passes decoded and reused, summed."""
        return self.gang.close(scope) if self.gang is not None else KeptCounts()

    def close(self) -> None:
        """Let the run's ranks go (when ``release_decoded`` has not), and shut down an
        embedded instance this run started, when asked to."""
        self.release_decoded("")
        if self.stop_embedded and self.started_local:
            from bnrecal.service.run.cluster import shutdown_embedded

            shutdown_embedded()


def on_ranks(
    dataset: DatasetSpec, batch_size: int, workers: int, device: str, settings: Settings, *,
    placement: str | None = None, samples: int | None = None, evaluation: EvalPlan | None = None,
    pool: WarmPool | None = None, control: RunControl | None = None, on_phase: Callable[[str], None] | None = None,
) -> RankPasses:
    """Passes on ``workers`` Ray rank actors outside a run (a bench, a test): placed and fed
    like a calibration's ranks, by the settings."""
    shards = eval_shards = None
    if resolve_data_transport(settings.data_transport) == "object_store":
        shards = ship_rank_shards(dataset, batch_size, workers) if dataset.remote is None else None
        if evaluation is not None and evaluation.dataset.remote is None:
            eval_shards = ship_rank_shards(evaluation.dataset, evaluation.batch_size, workers)
    ranks = RankSet(workers, device, group_options(settings, workers, device, placement), shards, eval_shards, pool)
    return RankPasses(ranks, dataset, batch_size, samples, evaluation, control=control, on_phase=on_phase)


def _loader_workers(data: DatasetSpec | LoaderSpec, cpus: float) -> int:
    """Loader processes of a rank: none for arrays and the caller's Python data (read as
    they are), else one per CPU beyond the first (images decode in parallel)."""
    return 0 if data.kind in ("array", "loader", "batches") else max(0, int(cpus) - 1)


def ship_rank_shards(dataset: DatasetSpec, batch_size: int, workers: int) -> list[Any]:
    """Each rank's samples of ``dataset``, put in the object store."""
    from bnrecal.workers.data import ship_dataset
    from bnrecal.workers.ranks.sharding import rank_ranges

    ranges = [rank_ranges(dataset.num_samples, batch_size, workers, r) for r in range(workers)]
    return ship_dataset(dataset, ranges)


def resolve_data_transport(setting: str) -> str:
    """Resolve ``auto``: share paths only on a single-node cluster this process is part of."""
    if setting != "auto":
        return setting
    import ray

    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    here = ray.get_runtime_context().get_node_id()
    return "shared" if alive == [here] else "object_store"


def group_options(settings: Settings, workers: int, device: str, placement: str | None = None) -> Any:
    """How a job's ``workers`` ranks are placed and timed, from the settings: CPUs and GPUs
    per rank, the placement strategy (``placement`` over the setting) and the timeouts; the
    same for the calibration's ranks and the INT8 range pass's."""
    from bnrecal.workers.ranks.plan import GroupOptions

    return GroupOptions(
        cpus_per_worker=cpus_per_worker(settings, workers),
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
