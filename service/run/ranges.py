"""Where the INT8 ranges are gathered: a :data:`RangeGatherer` runs the range pass over the
calibration samples with the calibration's sharding (docs/int8.md, "How the ranges are
gathered"). :func:`in_process` is this process as the world of one (``bnrecal export``,
the Python API, a one-worker run); the Ray ranks' gatherer is the executor's
(``service.run.executors``). Both give the same file.
"""

from __future__ import annotations

from collections.abc import Callable

from bnrecal.workers.data import DatasetSpec, iter_batches
from bnrecal.workers.data.kept import open_kept
from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.workers.ranks.int8_ranges import RangeRequest, range_pass
from bnrecal.workers.ranks.plan import GroupRanges
from bnrecal.workers.ranks.sharding import rank_ranges

RangeGatherer = Callable[[bytes, RangeRequest], GroupRanges]
"""Gathers the ranges of a prepared FP32 model (serialized) over the calibration samples."""


def in_process(dataset: DatasetSpec, batch_size: int, samples: int | None = None) -> RangeGatherer:
    """Gather in this process, over the first ``samples`` (default: all) of ``dataset`` at
    global batch ``batch_size`` (a world of one)."""

    def gather(model: bytes, request: RangeRequest) -> GroupRanges:
        ranges = rank_ranges(samples_read(dataset, samples), batch_size, 1, 0)
        with open_kept(dataset, dataset.open()) as data:
            result = range_pass(model, request, lambda: iter_batches(data, ranges), SingleProcessCollective(), 0)
        return GroupRanges(result, [result.samples], [result.collectives], ["in-process"], result.seconds)

    return gather


def samples_read(dataset: DatasetSpec, samples: int | None) -> int:
    """How many samples of ``dataset`` (in its order) a range pass reads."""
    return dataset.num_samples if samples is None else min(samples, dataset.num_samples)
