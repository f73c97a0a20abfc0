"""Reading the ranks' event streams on the driver, for every pass on a rank group (the
statistics' ``group`` and the INT8 ranges' ``range_group``): each rank's actor method is a
generator of events; the driver takes them as they come, from whichever rank is ready.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from bnrecal.errors import BnrecalError, CancelledError
from bnrecal.workers.ranks.events import RankEvent

WAIT_S = 0.2
"""How long the driver waits for an event before it looks at its deadlines again."""


def follow_streams(
    streams: Sequence[Any],
    cancel: threading.Event | None,
    failure: Callable[[int, RayTaskError | RayActorError], BnrecalError],
) -> Iterator[tuple[int, RankEvent] | None]:
    """Each rank's events as (rank, event), in the order they arrive, until every stream
    has ended; ``None`` after each wait, ready or not, so the caller checks its deadlines.
    Raises ``CancelledError`` once ``cancel`` is set, and ``failure(rank, error)`` when a
    rank's task fails or its actor dies."""
    rank_of = {id(stream): rank for rank, stream in enumerate(streams)}
    pending = list(streams)
    while pending:
        if cancel is not None and cancel.is_set():
            raise CancelledError("the job was cancelled")
        ready, _ = ray.wait(pending, num_returns=1, timeout=WAIT_S)
        for stream in ready:
            rank = rank_of[id(stream)]
            try:
                event = ray.get(next(stream))
            except StopIteration:
                pending.remove(stream)
                continue
            except (RayTaskError, RayActorError) as exc:
                raise failure(rank, exc) from None
            yield rank, event
        yield None
