"""The Ray actor that runs one rank of a calibration job."""

from __future__ import annotations

import gc
import os
import queue
import threading
import traceback
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from bnrecal.workers.ranks.process import start_up

start_up.pause()  # before the heavy imports, in a rank's own process only (start_up.py)

import ray  # noqa: E402
import torch  # noqa: E402

from bnrecal.workers.data import CalibrationData
from bnrecal.workers.data.reading.kept import STORE, KeptCounts, keep_one_scope
from bnrecal.workers.engine.batchnorm import layers_named
from bnrecal.workers.engine.statistics_pass import PassResult, calibration_pass
from bnrecal.workers.engine.evaluation import EvalMetrics, EvalTarget
from bnrecal.errors import BnrecalError, RunError, first_line
from bnrecal.workers.ranks.process.allocator import RANK_ENV_VARS, release_free_memory
from bnrecal.workers.ranks.process.ray_collective import RayCollective
from bnrecal.workers.ranks.events import (
    CalibrationDone, OnnxPassDone, RankEvent, RankHeartbeat, RankProgress, RankStarted,
)
from bnrecal.workers.ranks.process.work import checked_plan, evaluate_rank, keeping_head, rank_batches, row_of, stats_payload
from bnrecal.workers.ranks.plan import RankPlan
from bnrecal.workers.ranks.process.scoped import object_scopes, release_scope

T = TypeVar("T")

HEARTBEAT_S = 1.0
"""How often a rank reports while a step is in flight, so the driver can tell a rank
stuck in its own work (fewer collectives entered) from one waiting for its peers."""


@dataclass
class _Finished:
    """The work thread's last message: the calibration pass, the evaluation, and what the
    plan's checks found the evaluation measures, if any."""

    calibration: PassResult
    evaluation: EvalMetrics | None
    eval_target: EvalTarget | None = None


@dataclass(frozen=True)
class RankState:
    """What a job could leave behind in a rank's process (:meth:`CalibrationRank.state`): its
    pid, the jobs it ran, torch's thread count and initial seed, the collective groups still
    joined, the job scopes it keeps samples or objects for, and its allocator's environment variables."""

    pid: int
    jobs: int
    threads: int
    initial_seed: int
    groups: tuple[str, ...]
    kept: tuple[str, ...]
    allocator: dict[str, str | None]


@dataclass(frozen=True)
class RankNode:
    """Where a rank runs (:meth:`CalibrationRank.node`)."""

    rank: int
    node_id: str
    pid: int
    host: str


class CalibrationRank:
    """One rank: builds the model from the shared weights, reads its own shard, and
    streams progress events, then its result, back to the driver.

    Events are typed (``workers.ranks.events``): ``RankStarted`` once the rank has joined
    the collective group, ``RankProgress`` after each step (``phase`` ``evaluating``, without
    ``step``, after each evaluation batch), ``RankHeartbeat`` while a step is in flight, then
    ``CalibrationDone`` once. Errors become ``RunError`` naming the rank and its node.
    """

    def __init__(self, rank: int, num_threads: int) -> None:
        self.rank = rank
        self.num_threads = max(1, num_threads)
        torch.set_num_threads(self.num_threads)
        self.node_id = ray.get_runtime_context().get_node_id()
        self._collective: RayCollective | None = None
        self._seed = torch.initial_seed()
        self._groups: list[str] = []
        self.jobs = 0
        keep_one_scope()  # what it keeps of a job's samples, it keeps for that job only
        start_up.resume()

    def release_kept(self, scope: str) -> KeptCounts:
        """Drop the samples and objects this rank kept for the job ``scope`` (``workers.ranks.process.scoped``)
        and give their memory back; what the job's passes decoded and reused here."""
        counts = release_scope(scope)
        gc.collect()
        release_free_memory()
        return counts

    def reset(self) -> bool:
        """Clear what a job left, so a warm rank starts the next job as a fresh one would;
        True when it is clean (no collective group of a past job still joined).

        A job's model, data and work thread are locals of :meth:`run`, gone once it ends;
        the process-wide state is put back here: torch's thread count and RNG seed, grad
        mode, and the job's collective group (left in ``run``, checked here); the memory
        the job freed goes back to the system (``workers.ranks.process.allocator``).
        """
        from ray.util import collective

        self._leave_group()
        torch.set_num_threads(self.num_threads)
        torch.manual_seed(self._seed)
        torch.set_grad_enabled(True)
        gc.collect()
        release_free_memory()
        return not any(collective.is_group_initialized(name) for name in self._groups)

    def state(self) -> RankState:
        """What a job could leave behind in this process, for tests and diagnostics."""
        from ray.util import collective

        return RankState(
            pid=os.getpid(),
            jobs=self.jobs,
            threads=torch.get_num_threads(),
            initial_seed=torch.initial_seed(),
            groups=tuple(name for name in self._groups if collective.is_group_initialized(name)),
            kept=tuple(dict.fromkeys([*STORE.scopes(), *object_scopes()])),
            allocator={name: os.environ.get(name) for name in RANK_ENV_VARS},
        )

    def node(self) -> RankNode:
        """Where this rank runs: Ray node id, host and process id."""
        return RankNode(rank=self.rank, node_id=self.node_id, pid=os.getpid(), host=os.uname().nodename)

    def run(
        self,
        plan: RankPlan,
        weights: Any,
        shard: CalibrationData | None = None,
        eval_shard: CalibrationData | None = None,
    ) -> Iterator[RankEvent]:
        """Calibrate this rank's shard, then evaluate if the plan asks; yields progress
        events and finally the result (``workers.ranks.events``). ``weights`` are what the plan's model source
        builds the model from (a state dict, or a program's archive bytes).

        ``shard`` and ``eval_shard`` are this rank's data when it travels through the
        object store; without them the rank opens the datasets' paths itself (a shared
        filesystem).
        """
        self.jobs += 1
        with self._rank_named():
            yield from self._run(plan, weights, shard, eval_shard)

    def _run(
        self,
        plan: RankPlan,
        weights: Any,
        shard: CalibrationData | None,
        eval_shard: CalibrationData | None,
    ) -> Iterator[RankEvent]:
        device = torch.device(plan.device)
        model = plan.model.build(weights)
        model.to(device).eval()
        layers = layers_named(model, plan.layer_names)
        batches, ranges, steps = rank_batches(plan, self.rank, shard)
        head: list[tuple[int, torch.Tensor]] = []
        batches = keeping_head(batches, ranges, plan.head, head)
        self._groups = [plan.group_name]
        self._collective = RayCollective(plan.world_size, self.rank, plan.backend, plan.group_name)
        collective = self._collective
        yield RankStarted(self.rank, self.node_id)

        # The work runs on a thread so this generator can stream its progress as it goes.
        def work(emit: Callable[[RankEvent], None]) -> _Finished:
            def on_step(step: int, samples: int) -> None:
                emit(RankProgress(self.rank, samples, collective.calls, "calibrating", step))

            checked, eval_target = checked_plan(plan, model, layers)  # the host's checks, where it left them here
            result = calibration_pass(
                model,
                layers,
                batches,
                mode=plan.mode,
                collective=collective,
                call_order=checked.call_order,
                device=device,
                on_step=on_step,
                memory_format=plan.memory_format,
                sample_ranges=ranges,
                step_ranges=steps,
                feed=plan.feed,
                stop=plan.stop,
                row_of=row_of(plan),
            )
            evaluation = None
            if checked.evaluation is not None:
                evaluation = self._evaluate(checked, model, result, eval_shard, collective, emit)
            return _Finished(result, evaluation, eval_target)

        event = yield from self._streamed(work, collective, f"calibration-rank-{self.rank}")
        passed = event.calibration
        yield CalibrationDone(
            rank=self.rank, node_id=self.node_id, steps=passed.steps, samples=passed.samples,
            collectives=passed.collectives, collectives_total=collective.calls, calls=passed.calls,
            seconds=passed.seconds, memory_format=passed.memory_format,
            stats=stats_payload(passed) if self.rank == 0 else None,
            convergence=passed.convergence,
            evaluation=event.evaluation, head=head, eval_target=event.eval_target if self.rank == 0 else None,
        )

    def _evaluate(
        self,
        plan: RankPlan,
        model: torch.nn.Module,
        calibration: PassResult,
        shard: CalibrationData | None,
        collective: RayCollective,
        emit: Callable[[RankEvent], None],
    ) -> EvalMetrics:
        """Evaluate this rank's evaluation shard before and after; every rank gets the job's metrics."""

        def on_samples(samples: int) -> None:
            emit(RankProgress(self.rank, samples, collective.calls, "evaluating"))

        return evaluate_rank(plan, self.rank, model, calibration, shard, collective, on_samples)

    def onnx_pass(
        self,
        request: Any,
        dataset: Any,
        batch_size: int,
        world_size: int,
        backend: str,
        group_name: str,
        shard: CalibrationData | None = None,
        num_samples: int | None = None,
    ) -> Iterator[RankEvent]:
        """One onnxruntime pass (an ``OnnxPassRequest``: ``workers.ranks.ort.rank_pass``) over this
        rank's shard of the first ``num_samples`` (default: all) of ``dataset``, with the
        calibration's sharding rule, combined with the peers' in collectives: the INT8
        activation ranges of models, their top-1/top-5, the evaluation before and after.
        Streams events as ``run`` does: ``RankStarted``, a ``RankProgress`` per batch,
        ``RankHeartbeat`` while a batch or a collective is in flight, then ``OnnxPassDone``,
        so the driver's timeout counts time without progress, not the length of the pass."""
        from bnrecal.workers.data import iter_batches
        from bnrecal.workers.data.reading.kept import open_kept
        from bnrecal.workers.ranks.ort.rank_pass import onnx_pass
        from bnrecal.workers.ranks.sharding import rank_ranges

        self.jobs += 1
        self._groups = [group_name]
        with self._rank_named(" in an ONNX pass"):
            self._collective = RayCollective(world_size, self.rank, backend, group_name)
            collective = self._collective
            data = open_kept(dataset, shard if shard is not None else dataset.open())
            total = dataset.num_samples if num_samples is None else min(num_samples, dataset.num_samples)
            ranges = rank_ranges(total, batch_size, world_size, self.rank)
            yield RankStarted(self.rank, self.node_id)

            def work(emit: Callable[[RankEvent], None]) -> Any:
                def on_batch(samples: int) -> None:
                    emit(RankProgress(self.rank, samples, collective.calls, "onnx pass"))

                return onnx_pass(
                    request, ranges, lambda: iter_batches(data, ranges), collective, self.rank,
                    threads=self.num_threads, on_batch=on_batch,
                )

            passed = yield from self._streamed(work, collective, f"onnx-pass-rank-{self.rank}")
            yield OnnxPassDone(self.rank, self.node_id, passed)

    def call(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` in this rank's process (``workers.ranks.offload``): a later phase's
        own computing (onnxruntime's quantizer, a file's checks) on the CPUs this rank holds,
        off the job's host. An unexpected error names this rank, as a pass's does."""
        with self._rank_named(" in a later phase's work"):
            return work(*args)

    def _streamed(
        self, work: Callable[[Callable[[RankEvent], None]], T], collective: RayCollective, name: str
    ) -> Generator[RankEvent, None, T]:
        """Run ``work(emit)`` on a thread and stream what it emits as it goes, with a
        heartbeat (the collectives entered so far) whenever it is quiet for ``HEARTBEAT_S``;
        the generator's return value is ``work``'s (``result = yield from ...``)."""
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        done = object()
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append(work(events.put))
                events.put(done)
            except BaseException as exc:  # noqa: BLE001 - handed to the streaming side
                events.put(exc)

        worker = threading.Thread(target=run, name=name, daemon=True)
        worker.start()
        while True:
            try:
                event = events.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                yield RankHeartbeat(self.rank, collective.calls)
                continue
            if isinstance(event, BaseException):
                raise event
            if event is done:
                break
            yield event
        worker.join()
        return outcome[0]

    @contextmanager
    def _rank_named(self, doing: str = "") -> Iterator[None]:
        """Re-raise an unexpected error as a ``RunError`` that names this rank and its node
        (our own errors pass as they are), and leave the job's group whatever happens."""
        try:
            yield
        except BnrecalError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised with the rank named
            raise RunError(
                f"rank {self.rank} on node {self.node_id[:12]} failed{doing}: {type(exc).__name__}: {first_line(exc)}",
                rank=self.rank,
                node=self.node_id,
            ) from exc
        finally:
            self._leave_group()

    def _leave_group(self) -> None:
        if self._collective is not None:
            try:
                self._collective.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                traceback.print_exc()
            self._collective = None


CalibrationActor = ray.remote(CalibrationRank)
