"""Calibration data from Python objects: a map-style dataset read through each rank's own
``DataLoader``, or batches materialised on the driver (``bnrecal.recalibrate``).

A :class:`LoaderSpec` is described once on the driver and sent to every rank. Its steps
are the global batches, in order; rank k takes the k-th part of ``numpy.array_split`` of
every step's samples (docs/calibration.md, "Sharding"), also when that part is empty, so the ranks'
collectives pair up. A map-style dataset travels as the dataset object with its
``collate_fn`` and every step's sample indices: each rank decodes only its own samples, with
its own DataLoader workers. Materialised batches travel whole; each rank slices its part.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from bnrecal.errors import DatasetError, ModelInputError
from bnrecal.workers.data.summary import DatasetSummary


@dataclass(frozen=True)
class Step:
    """One rank's part of one global step: ``size`` samples in ``value`` (a batch in the
    user's structure, or the model's input tensor), ``None`` when the part is empty."""

    value: Any
    size: int


@dataclass(frozen=True)
class LoaderSpec:
    """Calibration data given as Python objects: what every rank needs to read its parts.

    ``kind`` is ``loader`` (``dataset``, ``collate_fn`` and each step's sample ``indices``)
    or ``batches`` (the materialised ``batches``). ``sizes`` counts each step's samples
    (after ``max_samples``). With ``select_input`` a rank feeds the model the batch's
    input only (a tensor, or the first element of a tuple or list).
    """

    kind: Literal["loader", "batches"]
    sizes: tuple[int, ...]
    sample_shape: tuple[int, ...]
    total_samples: int
    source: str
    select_input: bool = True
    dataset: Any = None
    collate_fn: Any = None
    indices: tuple[tuple[int, ...], ...] = ()
    batches: tuple[Any, ...] = ()
    num_workers: int = 0
    layout: None = None  # what DatasetSpec users read: no array layout, no transform
    transform: None = None
    remote: None = None

    @property
    def num_samples(self) -> int:
        """Samples over all steps."""
        return sum(self.sizes)

    @property
    def display_name(self) -> str:
        """What messages call the data."""
        return self.source

    def summary(self) -> DatasetSummary:
        """What reports and logs say about the data: its kind, name, counts, steps and shape."""
        return DatasetSummary(
            kind=self.kind, source=self.source, samples=self.num_samples, steps=len(self.sizes),
            total_samples=self.total_samples, sample_shape=self.sample_shape,
        )

    def step_ranges(self) -> list[tuple[int, int]]:
        """Each global step's ``[start, stop)`` in the data's global sample order."""
        offsets = np.cumsum((0, *self.sizes))
        return [(int(offsets[j]), int(offsets[j + 1])) for j in range(len(self.sizes))]

    def rank_ranges(self, rank: int, world_size: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s ``[start, stop)`` of every step (empty ranges included)."""
        ranges = []
        for start, stop in self.step_ranges():
            part = np.array_split(np.arange(start, stop), world_size)[rank]
            ranges.append((int(part[0]), int(part[-1]) + 1) if part.size else (start, start))
        return ranges

    def rank_steps(self, rank: int, world_size: int) -> Iterator[Step]:
        """Rank ``rank``'s part of every global step, in order, as :class:`Step` s."""
        if self.kind == "batches":
            yield from self._sliced_steps(rank, world_size)
        else:
            yield from self._loaded_steps(rank, world_size)

    def _sliced_steps(self, rank: int, world_size: int) -> Iterator[Step]:
        for batch, size in zip(self.batches, self.sizes, strict=True):
            if world_size == 1:  # the whole step: nothing to split (any batch update_bn takes)
                yield Step(self._input(batch), size)
                continue
            part = np.array_split(np.arange(size), world_size)[rank]
            if not part.size:
                yield Step(None, 0)
                continue
            yield Step(self._input(slice_batch(batch, int(part[0]), int(part[-1]) + 1)), int(part.size))

    def _loaded_steps(self, rank: int, world_size: int) -> Iterator[Step]:
        from torch.utils.data import DataLoader

        parts = [np.array_split(np.asarray(step, dtype=np.int64), world_size)[rank] for step in self.indices]
        own = [[int(i) for i in part] for part in parts if part.size]
        loader = DataLoader(
            self.dataset, batch_sampler=own, collate_fn=self.collate_fn, num_workers=self.num_workers if own else 0,
        )
        batches = iter(loader)
        for part in parts:
            if not part.size:
                yield Step(None, 0)
                continue
            yield Step(self._input(next(batches)), int(part.size))

    def _input(self, batch: Any) -> Any:
        return model_input(batch) if self.select_input else batch


def model_input(batch: Any) -> Any:
    """The model's input in a batch: the batch itself when it is a tensor, else the first
    element of a tuple or list: a tensor, or a list of per-sample tensors (detection-style
    images, :func:`per_sample`). A dict, or anything else, needs ``forward``."""
    value = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor) or _tensor_list(value):
        return value
    kind = "a dict" if isinstance(batch, dict) else f"of type {type(batch).__name__}"
    raise ModelInputError(
        f"a batch is {kind}: give forward=lambda model, batch: ... to say how the model takes it "
        "(a tensor, or a tuple or list whose first element is the input, needs none)"
    )


def call_model(model: Any, value: Any) -> Any:
    """Feed the model an input that is not one tensor (a list of per-sample images) as it is,
    the way ``update_bn`` does: ``model(value)``."""
    return model(value)


def per_sample(batch: Any) -> bool:
    """Whether a batch is detection-style: a tuple or list whose first element is a list of
    per-sample tensors (images of any sizes), beside per-sample lists (targets)."""
    return isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields") and bool(batch) \
        and _tensor_list(batch[0])


def batch_length(batch: Any) -> int:
    """The number of samples in a batch: its first tensor's (or array's) first dimension,
    the length of a detection-style batch's list of images, else the length of a list of
    plain values."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        if batch.ndim == 0:
            raise DatasetError("a batch is a 0-dimensional tensor: batches have the samples along dimension 0")
        return int(batch.shape[0])
    if per_sample(batch):
        return len(batch[0])
    if isinstance(batch, dict):
        values = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        if batch and all(_plain(v) for v in batch):
            return len(batch)
        values = list(batch)
    else:
        values = []
    for value in values:  # a tensor's samples first: a list beside it may be metadata
        if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim:
            return int(value.shape[0])
    for value in values:
        if not _plain(value):
            return batch_length(value)
    raise DatasetError(f"cannot tell how many samples a batch of type {type(batch).__name__} holds")


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``[start, stop)`` of a batch, keeping its structure: tensors and arrays along
    dimension 0, each member of a dict, tuple or list, a list of plain values or of
    per-sample items (a detection-style batch's images and targets) by position.

    A batch whose parts disagree on its number of samples cannot be split between
    workers: ``DatasetError`` says so and what to pass instead."""
    n = batch_length(batch)
    if per_sample(batch):  # each member by position: the images, their targets
        parts = [
            _by_position(member, start, stop, n) if isinstance(member, (tuple, list)) else _slice(member, start, stop, n)
            for member in batch
        ]
        return type(batch)(parts)
    return _slice(batch, start, stop, n)


def check_splittable(batch: Any) -> None:
    """Refuse, before any work, a batch :func:`slice_batch` cannot split by sample."""
    slice_batch(batch, 0, 0)


def _slice(value: Any, start: int, stop: int, n: int) -> Any:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0 or value.shape[0] != n:
            raise _unsplittable(n, f"a {type(value).__name__} of shape {tuple(value.shape)}")
        return value[start:stop]
    if isinstance(value, dict):
        return type(value)((key, _slice(item, start, stop, n)) for key, item in value.items())
    if isinstance(value, (tuple, list)):
        if not value or all(_plain(v) or isinstance(v, dict) for v in value):  # labels, names, target dicts
            return _by_position(value, start, stop, n)
        parts = [_slice(item, start, stop, n) for item in value]
        return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)
    return value


def _by_position(value: Any, start: int, stop: int, n: int) -> Any:
    if len(value) != n:
        raise _unsplittable(n, f"a {type(value).__name__} of {len(value)} items")
    return value[start:stop]


def _unsplittable(n: int, part: str) -> DatasetError:
    return DatasetError(
        f"a batch of {n} samples holds {part}: bnrecal cannot tell its samples apart to split it between "
        "workers; pass a DataLoader over a map-style Dataset (each worker collates its own samples), "
        "batches whose tensors all have the samples along dimension 0, or workers=1"
    )


def _tensor_list(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and not hasattr(value, "_fields") and bool(value) \
        and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in value)


def move_to(batch: Any, device: torch.device | str) -> Any:
    """The batch with every tensor in it on ``device`` (its structure kept)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)((key, move_to(value, device)) for key, value in batch.items())
    if isinstance(batch, (tuple, list)):
        parts = [move_to(value, device) for value in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    return batch


def sample_shape(batch: Any, select_input: bool) -> tuple[int, ...]:
    """One sample's shape as fed to the model, where the input is a tensor (else ``()``)."""
    try:
        value = model_input(batch) if select_input else batch
    except ModelInputError:
        return ()
    return tuple(value.shape[1:]) if isinstance(value, torch.Tensor) else ()


def _plain(value: Any) -> bool:
    return isinstance(value, (str, bytes, int, float, bool)) or value is None

