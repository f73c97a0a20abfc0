"""Ranks shared by many runs: a sweep's cells (docs/sweeps.md, "What is shared").

A sweep runs the one run core (``service.run.core``) once per cell, each run exactly the
single job of that model and set. What it shares is below the runs: :class:`SharedRanks`
is an executor that hands every run the same executor underneath (the same Ray ranks,
started once, or this process), whose per-run ``release_decoded`` and ``close`` keep the
ranks and what they decoded; every run keeps its samples under the sweep's scope, named
by its calibration set (``SharedScope``), so the next model over the same set reads them
decoded, bit for bit the floats a decode gives; and a set is described (listed, its labels
and first sample read) once. :meth:`SharedRanks.close` ends it all.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np
import torch

from bnrecal.workers.data import DatasetSpec
from bnrecal.workers.data.reading.kept import KeptCounts
from bnrecal.workers.ranks.plan import GroupResult, RankPlan

from bnrecal.service.run.core import Executor, KeepBudget, RankSet, RunPlan, SharedScope
from bnrecal.service.run.report.document import Placement

@dataclass(frozen=True)
class DescribedSet:
    """What a run reads of a data set before its ranks start, read once per sweep: its
    description, its ``first`` sample (the probe), and for evaluation data its labels."""

    dataset: DatasetSpec
    first: torch.Tensor
    labels: np.ndarray | None = None


class SharedRanks:
    """An executor for many runs over the same ranks: ``inner`` (``InProcess`` or
    ``RayRanks``) starts once, keeps its ranks from run to run, and keeps what they decode
    within ``keep`` (per rank: memory, then local disk) until :meth:`close`."""

    def __init__(self, inner: Executor, keep: KeepBudget) -> None:
        self.inner = inner
        self.keep = keep
        self.scope = uuid.uuid4().hex
        self.counts: KeptCounts | None = None
        self._lock = threading.Lock()
        self._described: dict[str, DescribedSet] = {}
        self._firsts: set[str] = set()

    def shared_scope(self, set_name: str) -> SharedScope:
        """Where a run over the calibration set ``set_name`` keeps its samples."""
        return SharedScope(self.scope, set_name)

    def described(self, key: str, describe: Callable[[], DescribedSet]) -> DescribedSet:
        """What ``describe`` makes of the data ``key`` names (its source and read options), made
        for the first run over it and the same for every later one: listing a prefix of
        shards or a folder of photos, reading the evaluation labels and each set's first
        sample (the runs' probes), once per sweep."""
        with self._lock:
            found = self._described.get(key)
        if found is None:
            found = describe()
            with self._lock:
                found = self._described.setdefault(key, found)
        return found

    def first(self, key: str) -> bool:
        """True for the first run that asks about ``key``, False for every later one: a check
        whose answer a sweep's options decide, made for its first cell (the INT8 file's
        ``keep_float`` names against the exported graph, ``recalibrate_to_files``)."""
        with self._lock:
            if key in self._firsts:
                return False
            self._firsts.add(key)
            return True

    def start(self, plan: RunPlan) -> None:
        """Start the ranks (the first run), or point them at this run's data."""
        self.inner.start(plan)

    def rank_plan(self, plan: RankPlan) -> RankPlan:
        """As the executor underneath completes it."""
        return self.inner.rank_plan(plan)

    def execute(
        self, plan: RankPlan, run: RunPlan, on_progress: Callable[[str, int], None], cancel: threading.Event | None
    ) -> GroupResult:
        """One attempt of a run's pass, on the shared ranks."""
        return self.inner.execute(plan, run, on_progress, cancel)

    def placement(self, run: RunPlan) -> Placement:
        """Where the shared ranks run."""
        return self.inner.placement(run)

    def ranks(self) -> RankSet | None:
        """The shared ranks, for a run's phases after its statistics."""
        return self.inner.ranks()

    def release_decoded(self, scope: str) -> KeptCounts:
        """A run is over: what it decoded stays for the next (counted at :meth:`close`)."""
        return KeptCounts()

    def close(self) -> None:
        """A run is over: its ranks stay for the next. The sweep's end is :meth:`finish`."""

    def finish(self) -> KeptCounts:
        """The sweep is over: drop what was kept, let the ranks go (to the pool, or stopped);
        what the runs decoded and reused, summed (idempotent)."""
        with self._lock:
            if self.counts is None:
                try:
                    self.counts = self.inner.release_decoded(self.scope)
                finally:
                    self.inner.close()
            return self.counts
