"""The ranks a job holds from its first pass to its end.

A job runs several passes on its ranks (the statistics with the evaluation, then the INT8
range passes and scoring passes), and each rank keeps the samples it decoded for the
later ones (``workers.data.reading.kept``). So the job holds its gang between passes, where it
used to give it back to the pool after each: a :class:`JobGang` stands where a pool does
for ``run_rank_group`` and ``run_range_group`` (``take``, ``give_back``), hands the same
gang to every pass of the job (reset and checked between passes, as a pool does), and at
the job's end (:meth:`JobGang.close`) asks each rank to drop what it kept, then passes the
gang on to the real pool, or kills it without one. A pass that fails kills its gang as
before; the next attempt starts or takes another.
"""

from __future__ import annotations

import logging
import threading

import ray

from bnrecal.workers.data.reading.kept import KeptCounts
from bnrecal.workers.ranks.gangs.pool import Gang, GangKey, WarmPool

log = logging.getLogger("bnrecal.pool")

RELEASE_TIMEOUT_S = 30.0
"""Longest the ranks may take to drop a job's kept samples before the gang is killed instead."""


class JobGang:
    """One job's gang, shared by its passes; ``pool`` (when given) lends it and takes it back."""

    def __init__(self, pool: WarmPool | None = None) -> None:
        self.pool = pool
        self._held: Gang | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """A job always keeps its gang between passes."""
        return True

    def group_name(self) -> str:
        """The placement group name of a gang this job starts (the pool's naming)."""
        return self.pool.group_name() if self.pool is not None else ""

    def take(self, key: GangKey, cancel: threading.Event | None = None) -> Gang | None:
        """The job's gang when it has the shape asked for and every rank confirmed its reset;
        else one from the pool, or None (the pass starts one)."""
        with self._lock:
            held, self._held = self._held, None
        if held is not None:
            if held.key == key and held.is_clean(cancel=cancel):
                return held
            held.kill()  # a rank of it did not answer: the job's kept samples go with it
        if self.pool is not None and self.pool.enabled:
            return self.pool.take(key, cancel)
        return None

    def give_back(self, gang: Gang) -> bool:
        """Hold a gang whose pass succeeded for the job's next pass (its ranks reset meanwhile)."""
        gang.start_reset()
        with self._lock:
            previous, self._held = self._held, gang
        if previous is not None and previous is not gang:
            self._let_go(previous, "")
        return True

    def close(self, scope: str) -> KeptCounts:
        """The job is over: each rank drops the samples it kept for ``scope``; the gang goes
        to the pool (or is killed). What the ranks decoded and reused, summed."""
        with self._lock:
            held, self._held = self._held, None
        if held is None:
            return KeptCounts()
        return self._let_go(held, scope)

    def _let_go(self, gang: Gang, scope: str) -> KeptCounts:
        try:
            counts = ray.get([actor.release_kept.remote(scope) for actor in gang.actors], timeout=RELEASE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a rank that cannot answer is not reusable
            log.warning("a rank did not drop its kept samples; its gang is killed", exc_info=True)
            gang.kill()
            return KeptCounts()
        if self.pool is not None:
            self.pool.give_back(gang)
        else:
            gang.kill()
        return sum(counts, KeptCounts())
