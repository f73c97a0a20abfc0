"""Work a job hands its ranks between passes: a later phase's own computing (onnxruntime's
pre-processing and quantizer, the entropy search, a file's checks) in the ranks' processes,
on the CPUs they hold, so that the job's host does none of it and a sweep's host work does
not grow with its cells (docs/int8.md, "The quantizer's work on the ranks").

A call is a function and its arguments, all picklable (the function travels by its
module's name: the rank imports it). The calls of one :func:`run_on_ranks` are spread over
the gang, call i on rank i mod K, each rank running its own in order, so K calls run side
by side. The gang is the job's (``workers.ranks.gangs.job_gang``), taken and given back as a pass
does. An object given to several calls travels to the object store once. A call that
raises fails with its own error (a ``BnrecalError`` as it is, anything else as a
``RunError`` naming the rank); a rank that dies names itself; a cancel stops the wait at
once; a rank whose calls do not answer within the collective timeout each (``GroupOptions``,
``BNRECAL_COLLECTIVE_TIMEOUT_S``) fails, so nothing waits on a stuck rank forever. A failure
kills the gang, as a failed pass does.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError, RayTaskError

from bnrecal.errors import BnrecalError, CancelledError, RunError, first_line
from bnrecal.workers.ranks.plan import GroupOptions
from bnrecal.workers.ranks.gangs.pool import GangKey, held_gang

T = TypeVar("T")

WAIT_S = 0.2
"""How long the driver waits for the calls before it looks at the cancel switch again."""


def run_on_ranks(
    work: Callable[..., T],
    calls: Sequence[tuple[Any, ...]],
    world_size: int,
    device: str,
    options: GroupOptions,
    *,
    pool: Any = None,
    cancel: threading.Event | None = None,
) -> list[T]:
    """``work(*args)`` for each ``args`` of ``calls`` on the job's ``world_size`` ranks
    (``pool``: its ``JobGang``, else a ``WarmPool``; without one a gang started for these
    calls), spread over them; the results in the order of ``calls``."""
    if not calls:
        return []
    with held_gang(GangKey.of(world_size, device, options), options, pool, cancel) as gang:
        _wait_until_up(gang.actors, options.placement_timeout_s, cancel)  # the timeout counts the calls, not a start
        shared = _shared_arguments(calls)
        refs = [
            gang.actors[i % len(gang.actors)].call.remote(work, *(shared.get(id(arg), arg) for arg in args))
            for i, args in enumerate(calls)
        ]
        return _gathered(refs, len(gang.actors), options.collective_timeout_s, cancel)


def _wait_until_up(actors: list[Any], timeout_s: float, cancel: threading.Event | None) -> None:
    """Until every rank answers (a gang started for these calls is still starting its
    processes), within the placement timeout."""
    pings = [actor.node.remote() for actor in actors]
    deadline = time.monotonic() + timeout_s
    pending = pings
    while pending:
        if cancel is not None and cancel.is_set():
            raise CancelledError("the job was cancelled")
        if time.monotonic() > deadline:
            late = pings.index(pending[0])
            raise RunError(f"rank {late} did not start within {timeout_s:g} s; raise BNRECAL_PLACEMENT_TIMEOUT_S",
                           rank=late)
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=WAIT_S)
    for rank, ping in enumerate(pings):
        try:
            ray.get(ping)
        except RayActorError as exc:
            raise RunError(f"rank {rank} died before a later phase's work: {first_line(exc)}", rank=rank) from None


def _shared_arguments(calls: Sequence[tuple[Any, ...]]) -> dict[int, Any]:
    """An object store reference for each object passed to more than one call (a model's
    bytes beside each of its candidate exclusions), put there once; by the object's id."""
    uses = Counter(id(arg) for args in calls for arg in {id(a): a for a in args}.values())
    objects = {id(arg): arg for args in calls for arg in args}
    return {key: ray.put(objects[key]) for key, count in uses.items() if count > 1 and _worth_sharing(objects[key])}


def _worth_sharing(arg: Any) -> bool:
    return not isinstance(arg, (int, float, str, bool, type(None)))


def _gathered(refs: list[Any], ranks: int, timeout_s: float, cancel: threading.Event | None) -> list[Any]:
    """Each call's result once all have answered (within ``timeout_s`` for each call a rank
    runs); raises the first failure (by call order)."""
    deadline = time.monotonic() + timeout_s * math.ceil(len(refs) / ranks)
    pending = list(refs)
    while pending:
        if cancel is not None and cancel.is_set():
            raise CancelledError("the job was cancelled")
        if time.monotonic() > deadline:
            waiting = set(pending)
            late = next(i for i, ref in enumerate(refs) if ref in waiting) % ranks
            raise RunError(
                f"rank {late} did not finish a later phase's work within {timeout_s:g} s a call; raise "
                "BNRECAL_COLLECTIVE_TIMEOUT_S if its work is legitimately this slow", rank=late,
            )
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=WAIT_S)
    results = []
    for i, ref in enumerate(refs):
        try:
            results.append(ray.get(ref))
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, BnrecalError):
                raise cause from None
            raise RunError(f"rank {i % ranks} failed in a later phase's work: {first_line(exc)}", rank=i % ranks) from None
        except RayActorError as exc:
            raise RunError(f"rank {i % ranks} died in a later phase's work: {first_line(exc)}", rank=i % ranks) from None
    return results
