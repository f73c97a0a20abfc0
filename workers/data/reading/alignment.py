"""Whether the samples one pass reads are exactly another dataset's samples: the calibration
data given again as the evaluation data, which a job then reads once for both (docs/data.md,
"Read once per job").

Two descriptions are the same samples when they read the same files the same way (the same
storage, listing, transform and image column; labels, order, seed and names aside) and the
first samples of one's order are all of the other's. Each sample then has a position in
both orders: a pass over one finds the other's position (its label, its part) by
:func:`positions_in`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from bnrecal.workers.data.spec import DatasetSpec


def _files(spec: DatasetSpec) -> DatasetSpec:
    """The description with what does not change the samples set aside."""
    return replace(spec, num_samples=spec.total_samples, source="", name=None, order="given", seed=0, keep=None,
                   part=spec.part.same_samples())  # an image listing is compared by its listing_digest


def positions_in(reading: DatasetSpec, count: int, other: DatasetSpec) -> np.ndarray | None:
    """Where each of the first ``count`` samples of ``reading``'s order stands in ``other``'s
    order (int64, one per position), when those samples are exactly ``other``'s samples;
    else None (then nothing is shared)."""
    if count != other.num_samples or count > reading.num_samples or _files(reading) != _files(other):
        return None
    rows, other_rows = reading.sample_rows()[:count], other.sample_rows()
    if not np.array_equal(np.sort(rows), np.sort(other_rows)):
        return None
    position_of_row = np.full(reading.total_samples, -1, dtype=np.int64)
    position_of_row[other_rows] = np.arange(len(other_rows), dtype=np.int64)
    return position_of_row[rows]
