"""The order a dataset's samples are taken in (docs/calibration.md, "Order").

``shuffled`` (the default of a run) takes the samples of a dataset given by path, upload or
URI in a seeded pseudo-random order, so that every prefix (``max_samples``) and every global
batch is a uniform random draw of the data, whatever order the files are in (an image folder
with class folders is read class by class). ``given`` keeps the file or array order.

The order is a permutation of the dataset's rows, computed from ``seed`` alone with numpy's
PCG64 generator: the driver and every rank compute the same one, so the result stays
deterministic and independent of the number of ranks (the sharding rule takes positions of
this order). Reading a step's rows in this order is made cheap where the storage cares:
:func:`sorted_runs` turns a slice of positions into runs of consecutive rows read in file
order (see ``ArrayData``), and the rows are put back in the step's order afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

Order = Literal["shuffled", "given"]
ORDERS: tuple[str, ...] = get_args(Order)


@dataclass(frozen=True)
class Sampling:
    """Which samples of a dataset are taken: the first ``max_samples`` (None: every one)
    positions of ``order``, seeded by ``seed`` when shuffled."""

    max_samples: int | None = None
    order: str = "given"
    seed: int = 0

    def kept(self, total: int) -> int:
        """How many of ``total`` samples are taken."""
        return min(total, self.max_samples or total)

    def rows(self, total: int) -> np.ndarray:
        """The row of each position taken (:func:`order_rows`)."""
        return order_rows(total, self.kept(total), self.order, self.seed)


def order_rows(total: int, count: int, order: str, seed: int) -> np.ndarray:
    """The row of each of the first ``count`` positions of ``order`` over ``total`` rows (int64).

    ``given``: rows ``0 .. count-1``. ``shuffled``: the first ``count`` entries of a seeded
    permutation of all ``total`` rows, so a smaller ``count`` is a prefix of a larger one.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    if not 0 <= count <= total:
        raise ValueError(f"count {count} outside [0, {total}]")
    if order == "given":
        return np.arange(count, dtype=np.int64)
    return np.random.Generator(np.random.PCG64(seed)).permutation(total)[:count].astype(np.int64)


def sorted_runs(rows: np.ndarray, max_gap: int = 0) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """How to read ``rows`` in file order: the permutation that sorts them, and the sorted
    rows as ``[start, stop)`` runs of consecutive rows (rows up to ``max_gap`` apart share a
    run, read through the gap: one ranged request instead of two).

    Reading the runs in turn and taking rows ``sorted[k]`` gives the rows sorted; place
    them at ``permutation`` to get them back in ``rows``'s order.
    """
    permutation = np.argsort(rows, kind="stable")
    ordered = rows[permutation]
    runs: list[tuple[int, int]] = []
    for row in ordered.tolist():
        if runs and row - runs[-1][1] <= max_gap:
            runs[-1] = (runs[-1][0], max(runs[-1][1], row + 1))
        else:
            runs.append((row, row + 1))
    return permutation, runs


def gather_runs(
    ordered: np.ndarray,
    read: Callable[[int, int], np.ndarray] | None,
    max_gap: int,
    fetch: Callable[[list[tuple[int, int]]], list[np.ndarray]] | None = None,
) -> np.ndarray:
    """Sorted rows ``ordered`` read as runs of consecutive rows (``read(start, stop)`` each,
    or ``fetch(runs)`` all at once; rows with at most ``max_gap`` rows between them read
    through the gap), each row taken from its run."""
    _, runs = sorted_runs(ordered, max_gap)
    if fetch is not None:
        parts = fetch(runs)
    else:
        assert read is not None
        parts = [read(a, b) for a, b in runs]
    starts = np.array([a for a, _ in runs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([b - a for a, b in runs])[:-1]]).astype(np.int64)
    run = np.searchsorted(starts, ordered, side="right") - 1
    stacked = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return stacked[offsets[run] + ordered - starts[run]]


READ_AHEAD_BYTES = 64 * 1024 * 1024
"""Rows read ahead, in one sorted pass, for the next steps of a shuffled order over
storage where each read is costly (a compressed member, object storage)."""


class ReadAhead:
    """Reading a shuffled order several steps at a time, for an array reader whose single
    reads are costly. The reader provides ``order`` (the row of each position), ``_gather(rows)``
    (rows in any order, read sorted), ``_compact_row_bytes()`` and ``_reads_ahead``."""

    order: np.ndarray | None
    _reads_ahead: bool

    def _gather(self, rows: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _compact_row_bytes(self) -> int:
        raise NotImplementedError

    def plan_reads(self, ranges: list[tuple[int, int]]) -> None:
        """The ranges this reader will load, in order (a rank's steps): with a shuffled order
        over storage where each read is costly, the rows of the next steps, up to
        ``READ_AHEAD_BYTES``, are then read together in file order."""
        self._plan = [(a, b) for a, b in ranges if b > a]
        self._planned = {r: i for i, r in enumerate(self._plan)}
        self._window: dict[int, np.ndarray] = {}

    def _planned_read(self, start: int, stop: int) -> np.ndarray | None:
        """Positions ``[start, stop)`` from the rows read ahead (reading the next window when
        they are not there yet); None where this range was not planned or needs no window."""
        if self.order is None or not self._reads_ahead or (start, stop) not in self._planned:
            return None
        rows = self.order[start:stop].tolist()
        if any(row not in self._window for row in rows):
            self._read_ahead(self._planned[(start, stop)])
        return np.stack([self._window.pop(row) for row in rows])

    def _read_ahead(self, first: int) -> None:
        """Read the rows of planned ranges ``first, first+1, ...`` (at least one, at most
        ``READ_AHEAD_BYTES`` of them) in one sorted pass, into the window."""
        assert self.order is not None
        row_bytes = max(1, self._compact_row_bytes())
        wanted: list[np.ndarray] = []
        size = 0
        for a, b in self._plan[first:]:
            if wanted and size + (b - a) * row_bytes > READ_AHEAD_BYTES:
                break
            wanted.append(self.order[a:b])
            size += (b - a) * row_bytes
        rows = np.concatenate(wanted)
        self._window = dict(zip(rows.tolist(), self._gather(rows)))
