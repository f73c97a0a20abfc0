"""The driver's side of INT8 range collection: K rank actors gather the activation
ranges of the folded FP32 model over their shards (docs/int8.md, "How the ranges are gathered").

The ranks are placed and supervised like a calibration's (``workers.ranks.group``): a warm
gang of the same shape from the pool when one is idle, else a new one; any failure names
the rank and its node; a job making no progress within the collective timeout fails;
actors go back to the pool after a success and are killed otherwise.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from bnrecal.workers.data import DatasetSpec
from bnrecal.errors import BnrecalError, CancelledError, RunError, first_line
from bnrecal.workers.ranks.group import GroupOptions
from bnrecal.workers.ranks.int8_ranges import RangeRequest, RangeResult
from bnrecal.workers.ranks.pool import Gang, GangKey, WarmPool


@dataclass
class GroupRanges:
    """What the ranks gathered together: rank 0's combined result (every rank holds the
    same), the samples each rank read, the collectives each made, and their nodes."""

    result: RangeResult
    samples: list[int]
    collectives: list[int]
    nodes: list[str]
    seconds: float


def run_range_group(
    model: bytes,
    request: RangeRequest,
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
) -> GroupRanges:
    """Gather the ranges on ``world_size`` rank actors over the first ``num_samples``
    (default: all) of ``dataset``; ``shards`` (one per rank) carry the data through the
    object store, else every rank opens ``dataset`` from its path."""
    key = GangKey(world_size, options.cpus_per_worker, options.gpus_per_worker, options.placement_strategy, device)
    gang = pool.take(key, cancel) if pool is not None and pool.enabled else None
    if gang is None:
        gang = Gang.start(key, options.placement_timeout_s, cancel, name=pool.group_name() if pool is not None else "")
    group_name = f"bnrecal-int8-{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    succeeded = False
    try:
        model_ref = ray.put(model)
        calls = [
            actor.collect_ranges.remote(
                model_ref, request, dataset, batch_size, world_size, backend, group_name,
                shards[rank] if shards is not None else None, num_samples,
            )
            for rank, actor in enumerate(gang.actors)
        ]
        answers = _wait_all(calls, options.placement_timeout_s + options.collective_timeout_s, cancel)
        succeeded = True
    finally:
        if succeeded and pool is not None:
            pool.give_back(gang)
        else:
            gang.kill()
    answers.sort(key=lambda answer: answer["rank"])
    return GroupRanges(
        result=answers[0]["result"],
        samples=[answer["result"].samples for answer in answers],
        collectives=[answer["result"].collectives for answer in answers],
        nodes=[answer["node_id"] for answer in answers],
        seconds=time.monotonic() - started,
    )


def _wait_all(calls: list[Any], timeout_s: float, cancel: threading.Event | None) -> list[dict[str, Any]]:
    """Every rank's answer; the first failure (a dead rank before its peers' broken links)
    becomes one error naming the rank."""
    deadline = time.monotonic() + timeout_s
    pending = list(calls)
    while pending:
        if cancel is not None and cancel.is_set():
            raise CancelledError("the job was cancelled")
        if time.monotonic() > deadline:
            raise RunError(
                f"INT8 range collection made no progress for {timeout_s:g} s; "
                "raise BNRECAL_COLLECTIVE_TIMEOUT_S if the passes are legitimately this slow"
            )
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
        for call in calls:
            if call in pending:
                continue
            try:
                ray.get(call, timeout=0)
            except RayActorError as exc:
                raise RunError(f"rank {calls.index(call)} died gathering INT8 ranges: {first_line(exc)}",
                               rank=calls.index(call)) from None
            except RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, BnrecalError):
                    raise cause from None
                raise RunError(f"rank {calls.index(call)} failed gathering INT8 ranges: {first_line(exc)}",
                               rank=calls.index(call)) from None
    return [ray.get(call) for call in calls]
