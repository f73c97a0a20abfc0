"""The driver's side of an onnxruntime pass on the ranks (``workers.ranks.ort.rank_pass``): K
rank actors run the pass's models over their shards, the INT8 ranges, scores and the
evaluation before and after combined in collectives (docs/int8.md, "How the ranges are
gathered").

The ranks are placed and supervised like a calibration's (``workers.ranks.group``): the
job's gang (or a warm one of the same shape from the pool, else a new one); any failure
names the rank and its node; a pass making no progress within the collective timeout
fails; the gang goes back after a success and is killed otherwise. Each rank streams its
progress, so the timeout counts time without progress, never the length of the pass.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayTaskError

from bnrecal.workers.data import DatasetSpec
from bnrecal.errors import BnrecalError, RunError, first_line
from bnrecal.workers.ranks.events import OnnxPassDone, RankHeartbeat, RankProgress, RankStarted
from bnrecal.workers.ranks.group import GroupOptions
from bnrecal.workers.ranks.ort.rank_pass import OnnxPassRequest, pass_phase
from bnrecal.workers.ranks.plan import GroupPass
from bnrecal.workers.ranks.gangs.pool import GangKey, WarmPool, held_gang
from bnrecal.workers.ranks.streams import follow_streams


def run_onnx_pass_group(
    request: OnnxPassRequest,
    dataset: DatasetSpec,
    batch_size: int,
    world_size: int,
    device: str,
    backend: str,
    options: GroupOptions,
    *,
    num_samples: int | None = None,
    shards: Sequence[Any] | None = None,
    pool: WarmPool | None = None,
    cancel: threading.Event | None = None,
) -> GroupPass:
    """Run the pass ``request`` on ``world_size`` rank actors over the first ``num_samples``
    (default: all) of ``dataset``, by the calibration's sharding at ``batch_size``; ``shards``
    (one per rank) carry the data through the object store, else every rank opens
    ``dataset`` from its path."""
    what = f"the {pass_phase(request)} pass"
    key = GangKey.of(world_size, device, options)
    group_name = f"bnrecal-onnx-{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    with held_gang(key, options, pool, cancel) as gang:
        request_ref = ray.put(request)
        streams = [
            actor.onnx_pass.remote(
                request_ref, dataset, batch_size, world_size, backend, group_name,
                shards[rank] if shards is not None else None, num_samples,
            )
            for rank, actor in enumerate(gang.actors)
        ]
        answers = _follow(streams, options, cancel, what)
    answers.sort(key=lambda answer: answer.rank)
    return GroupPass(
        result=answers[0].result,
        samples=[answer.result.samples for answer in answers],
        collectives=[answer.result.collectives for answer in answers],
        nodes=[answer.node_id for answer in answers],
        seconds=time.monotonic() - started,
    )


def _follow(
    streams: list[Any], options: GroupOptions, cancel: threading.Event | None, what: str,
) -> list[OnnxPassDone]:
    """Every rank's result, from its event stream. The ranks must start within the placement
    timeout; after that the pass fails only when no rank made progress (a batch run, a
    collective entered) for the collective timeout: a long pass is not a stuck one."""
    results: list[OnnxPassDone] = []
    nodes: dict[int, str] = {}
    calls = [0] * len(streams)
    started: set[int] = set()
    startup_deadline = time.monotonic() + options.placement_timeout_s
    last_progress = time.monotonic()
    for arrived in follow_streams(streams, cancel, lambda rank, exc: _failure(rank, exc, nodes.get(rank), what)):
        if arrived is not None:
            rank, event = arrived
            if isinstance(event, RankStarted):
                started.add(rank)
                nodes[rank] = event.node_id
            elif isinstance(event, RankHeartbeat) and event.calls == calls[rank]:
                continue  # alive, but no further on
            elif isinstance(event, OnnxPassDone):
                results.append(event)
            if isinstance(event, (RankHeartbeat, RankProgress)):
                calls[rank] = event.calls
            last_progress = time.monotonic()
            continue
        if len(started) < len(streams):
            if time.monotonic() > startup_deadline:
                late = sorted(set(range(len(streams))) - started)
                raise RunError(
                    f"ranks {late} did not start {what} within {options.placement_timeout_s:g} s; "
                    "raise BNRECAL_PLACEMENT_TIMEOUT_S", rank=late[0],
                )
        elif time.monotonic() - last_progress > options.collective_timeout_s:
            behind = min((r for r in range(len(streams)) if all(a.rank != r for a in results)), default=0,
                         key=lambda r: calls[r])
            node = nodes.get(behind, "unknown")
            raise RunError(
                f"{what[0].upper()}{what[1:]} made no progress for {options.collective_timeout_s:g} s (rank {behind} on "
                f"node {node[:12]}, {calls[behind]} collectives entered); raise BNRECAL_COLLECTIVE_TIMEOUT_S if "
                "its batches are legitimately this slow", rank=behind, node=node,
            )
    return results


def _failure(rank: int, exc: BaseException, node: str | None, what: str) -> BnrecalError:
    """The error of a rank that failed or died, naming it and its node."""
    where = f"rank {rank} on node {(node or 'unknown')[:12]}"
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BnrecalError):
            if isinstance(cause, RunError) and cause.node is None:
                return RunError(cause.message, rank=rank, node=node)
            return cause
        return RunError(f"{where} failed in {what}: {first_line(exc)}", rank=rank, node=node)
    return RunError(f"{where} died in {what}: {first_line(exc)}", rank=rank, node=node)
