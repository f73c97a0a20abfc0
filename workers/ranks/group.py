"""The driver's side of a job: K rank actors, their placement, progress and faults.

``run_rank_group`` places K actors with a placement group (or takes a warm gang of them
from a :class:`~workers.ranks.gangs.pool.WarmPool`), hands each the plan and the weights (put in the
object store once), follows the progress they stream, and returns
rank 0's statistics. Any failure, a rank that dies, a rank that raises, or a job that
makes no progress within the collective timeout, fails the job with an error naming
the rank and its node; actors and the placement group are always released (or, after
a success, handed back to the pool).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group_table

from bnrecal.errors import BnrecalError, CallOrderError, RunError, first_line
from bnrecal.workers.ranks.events import CalibrationDone, RankHeartbeat, RankProgress, RankStarted
from bnrecal.workers.ranks.process.work import joined_head
from bnrecal.workers.ranks.plan import GroupOptions, GroupResult, RankPlan
from bnrecal.workers.ranks.gangs.pool import GangKey, WarmPool, held_gang
from bnrecal.workers.ranks.streams import follow_streams

ProgressCallback = Callable[[str, int], None]
"""Called with the phase (``calibrating``, ``evaluating``) and the number of samples all
ranks have processed in it so far."""


def run_rank_group(
    plan: RankPlan,
    weights: Any,
    options: GroupOptions,
    *,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    shards: Sequence[Any] | None = None,
    eval_shards: Sequence[Any] | None = None,
    pool: WarmPool | None = None,
) -> GroupResult:
    """Run a job on ``plan.world_size`` rank actors and return their combined result.

    ``weights`` (a state dict, or a program's archive bytes: what the plan's model source
    builds from) go into the object store once for every rank.

    ``shards`` (one per rank) carry the data through the object store, and
    ``eval_shards`` the evaluation data; without them every rank opens the datasets
    from their paths. With a ``pool`` the ranks are a warm gang of the same shape when
    one is idle, and go back to it after a successful job; without, they are started
    for this job and killed after it.
    """
    world_size = plan.world_size
    plan = replace(plan, group_name=plan.group_name or f"bnrecal-{uuid.uuid4().hex[:12]}")
    key = GangKey.of(world_size, plan.device, options)
    with held_gang(key, options, pool, cancel) as gang:
        state_ref = ray.put(weights)
        streams = [
            actor.run.remote(
                plan,
                state_ref,
                shards[rank] if shards is not None else None,
                eval_shards[rank] if eval_shards is not None else None,
            )
            for rank, actor in enumerate(gang.actors)
        ]
        return _follow(streams, gang.group, plan, options, on_progress, cancel)


def _bundle_nodes(group: Any) -> dict[int, str]:
    """Node of each bundle, until the ranks report their own."""
    try:
        return {int(k): v for k, v in placement_group_table(group).get("bundles_to_node_id", {}).items()}
    except Exception:  # noqa: BLE001 - node names are for messages only
        return {}


def _follow(
    streams: list[Any],
    group: Any,
    plan: RankPlan,
    options: GroupOptions,
    on_progress: ProgressCallback | None,
    cancel: threading.Event | None,
) -> GroupResult:
    """Consume every rank's event stream until all have sent their result."""
    results: dict[int, CalibrationDone] = {}
    steps_done = [0] * len(streams)
    calls_entered = [0] * len(streams)
    started: set[int] = set()
    nodes = _bundle_nodes(group)
    samples_done = {"calibrating": 0, "evaluating": 0}
    startup_deadline = time.monotonic() + options.placement_timeout_s
    last_progress = time.monotonic()
    for arrived in follow_streams(streams, cancel, lambda rank, exc: _root_cause(rank, exc, streams, nodes)):
        if arrived is not None:
            rank, event = arrived
            if isinstance(event, RankStarted):
                started.add(rank)
                nodes[rank] = event.node_id
                last_progress = time.monotonic()
            elif isinstance(event, RankHeartbeat):
                if event.calls != calls_entered[rank]:
                    calls_entered[rank] = event.calls
                    last_progress = time.monotonic()
            elif isinstance(event, RankProgress):
                if event.step is not None:
                    steps_done[rank] = event.step + 1
                calls_entered[rank] = event.calls
                samples_done[event.phase] += event.samples
                last_progress = time.monotonic()
                if on_progress is not None:
                    on_progress(event.phase, samples_done[event.phase])
            elif isinstance(event, CalibrationDone):
                results[rank] = event
                last_progress = time.monotonic()
            continue
        if plan.mode == "sync" and results:
            _check_collective_counts(results, calls_entered, nodes)
        if len(started) < len(streams):
            if time.monotonic() > startup_deadline:
                late = sorted(set(range(len(streams))) - started)
                raise RunError(
                    f"ranks {late} did not start within {options.placement_timeout_s:g} s (building the model, "
                    "opening the data, joining the collective group); raise BNRECAL_PLACEMENT_TIMEOUT_S",
                    rank=late[0],
                )
        elif time.monotonic() - last_progress > options.collective_timeout_s:
            behind = min(range(len(streams)), key=lambda r: (r in results, calls_entered[r], steps_done[r]))
            node = nodes.get(behind, "unknown")
            raise RunError(
                f"rank {behind} on node {node[:12]} made no progress for {options.collective_timeout_s:g} s "
                f"(at step {steps_done[behind]}, {calls_entered[behind]} collectives entered): "
                "the job's collectives timed out waiting for it; raise BNRECAL_COLLECTIVE_TIMEOUT_S "
                "if steps are legitimately this slow",
                rank=behind,
                node=node,
            )
    first = results[0]
    return GroupResult(
        stats=first.stats,
        steps=first.steps,
        samples=sum(r.samples for r in results.values()),
        collectives=[results[r].collectives for r in sorted(results)],
        seconds=max(r.seconds for r in results.values()),
        nodes=[results[r].node_id for r in sorted(results)],
        calls=first.calls,
        memory_formats=[results[r].memory_format for r in sorted(results)],
        evaluation=first.evaluation,
        convergence=first.convergence,
        head=joined_head(part for r in results.values() for part in r.head),
        eval_target=first.eval_target,
    )


def _check_collective_counts(
    results: dict[int, CalibrationDone], calls_entered: list[int], nodes: dict[int, str]
) -> None:
    """In sync mode every rank makes the same collectives: one that enters more than a
    finished peer made waits for a partner that will never come, so fail now, naming it."""
    finished = min(results.values(), key=lambda r: r.collectives_total)
    for rank, calls in enumerate(calls_entered):
        if rank not in results and calls > finished.collectives_total:
            raise CallOrderError(
                f"rank {rank} entered collective {calls} but rank {finished.rank} finished after "
                f"{finished.collectives_total}: the ranks called BN layers a different number of times "
                "(data-dependent control flow in the model?); sync mode needs the same calls on every rank, "
                "--mode local does not",
                rank=rank,
                node=nodes.get(rank),
            )


def _root_cause(rank: int, exc: BaseException, streams: list[Any], nodes: dict[int, str]) -> BnrecalError:
    """The most telling error among the ranks: a dead rank beats its peers' broken links."""
    deadline = time.monotonic() + 3.0
    errors: dict[int, BaseException] = {rank: exc}
    for other, stream in enumerate(streams):
        if other == rank:
            continue
        remaining = max(0.0, deadline - time.monotonic())
        try:
            ready, _ = ray.wait([stream], timeout=remaining)
            if ready:
                ray.get(next(stream))
        except (RayTaskError, RayActorError) as other_exc:
            errors[other] = other_exc
        except StopIteration:
            pass
    died = [r for r, e in errors.items() if isinstance(e, RayActorError)]
    culprit = died[0] if died else rank
    return _describe(culprit, errors[culprit], nodes.get(culprit, "unknown"))


def _describe(rank: int, exc: BaseException, node: str) -> BnrecalError:
    if isinstance(exc, RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        if isinstance(cause, BnrecalError):
            return cause
        return RunError(f"rank {rank} on node {node[:12]} failed: {first_line(cause)}", rank=rank, node=node)
    reason = first_line(exc)
    lost = " (the node left the cluster)" if node not in _alive_nodes() else ""
    return RunError(f"rank {rank} on node {node[:12]}{lost} died: {reason}", rank=rank, node=node)


def _alive_nodes() -> set[str]:
    try:
        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:  # noqa: BLE001 - for the message only
        return set()
