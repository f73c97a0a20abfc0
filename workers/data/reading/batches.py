"""Turn a rank's per-step sample ranges into batches, decoding images ahead in worker processes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from bnrecal.workers.data.opened import CalibrationData
from bnrecal.workers.data.reading.kept import KeptData
from bnrecal.errors import BnrecalError


class _LoadFailure:
    """A load error carried back from a DataLoader worker, re-raised as is in the consumer."""

    def __init__(self, error: BnrecalError) -> None:
        self.error = error


class _RangeLoads(Dataset[torch.Tensor | _LoadFailure]):
    """Item ``i`` is the whole batch of range ``i``; errors come back as values (one-line messages)."""

    def __init__(self, data: CalibrationData, ranges: Sequence[tuple[int, int]], kept: bool = False) -> None:
        self.data = data
        self.ranges = ranges
        self.kept = kept  # load_kept (the consumer keeps and finishes each batch), else load

    def __len__(self) -> int:
        return len(self.ranges)

    def __getitem__(self, index: int) -> torch.Tensor | _LoadFailure:
        start, stop = self.ranges[index]
        try:
            return self.data.load_kept(start, stop) if self.kept else self.data.load(start, stop)
        except BnrecalError as exc:
            return _LoadFailure(exc)


def iter_batches(
    data: CalibrationData,
    ranges: Sequence[tuple[int, int]],
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    multiprocessing_context: str | None = None,
) -> Iterator[torch.Tensor]:
    """Yield one float32 batch per range, in order; an empty range gives an empty batch.

    For image data with ``num_workers > 0`` the batches are decoded ahead in DataLoader
    worker processes (each worker decodes whole batches); array data is read straight from
    its memory map, where workers would only add copying. ``pin_memory`` pins each batch
    for a fast non-blocking copy to a GPU.
    """
    checked = [(int(start), int(stop)) for start, stop in ranges]
    for start, stop in checked:
        if not (0 <= start <= stop <= len(data)):
            raise IndexError(f"sample range [{start}, {stop}) is outside [0, {len(data)})")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if isinstance(data, KeptData):  # a rank's kept samples: only the ranges not kept yet are decoded
        to_decode = [r for r, needed in zip(checked, data.missing(checked)) if needed]
        decoded = _decoded(data.inner, to_decode, num_workers, multiprocessing_context, kept=True)
        for batch in data.kept_batches(checked, decoded):
            yield batch.pin_memory() if pin_memory else batch
        return
    yield from _decoded(data, checked, num_workers, multiprocessing_context, pin_memory=pin_memory)


def _decoded(
    data: CalibrationData, ranges: list[tuple[int, int]], num_workers: int, multiprocessing_context: str | None,
    *, kept: bool = False, pin_memory: bool = False,
) -> Iterator[torch.Tensor]:
    """One batch per range, in order (``load_kept``'s form with ``kept``), decoded ahead in
    DataLoader workers when the data decodes and workers are asked for."""
    plan = getattr(data, "plan_reads", None)
    if plan is not None:  # a reader that reads ahead in a shuffled order learns the steps to come
        plan(ranges)
    if num_workers == 0 or not data.decodes or not ranges:
        for start, stop in ranges:
            batch = data.load_kept(start, stop) if kept else data.load(start, stop)
            yield batch.pin_memory() if pin_memory else batch
        return
    loader = DataLoader(
        _RangeLoads(data, ranges, kept),
        batch_size=None,
        shuffle=False,
        num_workers=min(num_workers, len(ranges)),
        pin_memory=pin_memory,
        multiprocessing_context=multiprocessing_context,
    )
    batches = iter(loader)
    try:
        for item in batches:
            if isinstance(item, _LoadFailure):
                raise item.error
            yield item
    finally:
        del batches  # shuts the worker processes down now, also when the consumer stops early
