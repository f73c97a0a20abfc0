"""The order a dataset's samples are taken in (contract section 1, "Order").

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

from typing import Literal, get_args

import numpy as np

Order = Literal["shuffled", "given"]
ORDERS: tuple[str, ...] = get_args(Order)


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
