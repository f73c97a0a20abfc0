"""Calibration data that reaches the actors through the Ray object store.

On a cluster whose nodes do not share the driver's filesystem, the driver reads the
data once and puts each rank's own samples in the object store, in blocks of about
``block_bytes``; an actor fetches only its own blocks, one at a time, as its steps
reach them. Arrays travel in their compact type (uint8 stays uint8: a quarter of the
bytes of float32) and become float32 in the actor; images travel as their encoded file
bytes and are decoded in the actor, and so do the samples of shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bnrecal.workers.data.formats.arrays import ArrayData
from bnrecal.workers.data.opened import CalibrationData, DecodedData
from bnrecal.workers.data.formats.images import ImageData
from bnrecal.workers.data.shards.dataset import ShardData, decode_kept, from_kept_batch, kept_batch
from bnrecal.workers.data.spec import DatasetSpec
from bnrecal.workers.data.formats.transform import ImageTransform

DEFAULT_BLOCK_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ShippedBlock:
    """One object-store block: the sample ranges it holds, in order, and its reference."""

    ranges: tuple[tuple[int, int], ...]
    ref: Any  # ray.ObjectRef: tensor of rows (arrays) or list of (name, bytes) (images)
    nbytes: int = 0  # payload bytes put in the object store


class ShippedData(DecodedData):
    """One rank's samples, read from its object-store blocks instead of a path."""

    def __init__(
        self,
        blocks: Sequence[ShippedBlock],
        num_samples: int,
        sample_shape: tuple[int, ...],
        transform: ImageTransform | None,
    ) -> None:
        self.blocks = tuple(blocks)
        self.num_samples = num_samples
        self.sample_shape = tuple(sample_shape)
        self.transform = transform
        self._where = {r: (i, offset) for i, b in enumerate(self.blocks) for r, offset in _offsets(b.ranges)}
        self._cached: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def from_kept(self, kept: torch.Tensor) -> torch.Tensor:
        """Kept samples as ``load`` gives them: arrays as float32, image crops normalised."""
        return from_kept_batch(kept, self.transform).to(torch.float32)

    def load_kept(self, start: int, stop: int) -> torch.Tensor:
        """One of this rank's ranges as it travelled (arrays in their compact type), images
        decoded to their uint8 crops."""
        self._check_range(start, stop)
        if start == stop:
            return self._empty()
        if (start, stop) not in self._where:
            raise IndexError(f"range [{start}, {stop}) was not shipped to this rank")
        index, offset = self._where[(start, stop)]
        block = self._block(index)
        rows = block[offset : offset + stop - start]
        if isinstance(rows, torch.Tensor):
            return rows
        return kept_batch([decode_kept(name, data, self.transform) for name, data in rows], self.transform)

    def encoded(self, start: int, stop: int) -> list[tuple[str, bytes]] | None:
        """One of this rank's ranges as its encoded samples (None for arrays)."""
        if self.transform is None:
            return None
        self._check_range(start, stop)
        if start == stop:
            return []
        if (start, stop) not in self._where:
            raise IndexError(f"range [{start}, {stop}) was not shipped to this rank")
        index, offset = self._where[(start, stop)]
        return list(self._block(index)[offset : offset + stop - start])

    def first_encoded(self) -> tuple[str, bytes] | None:
        """The first sample of this rank's first range (its block, fetched, is the pass's first)."""
        ranges = [r for block in self.blocks for r in block.ranges if r[1] > r[0]]
        first = self.encoded(*ranges[0]) if ranges else None
        return first[0] if first else None

    @property
    def worth_keeping(self) -> bool:
        """Encoded images are decoded on every read: worth keeping; arrays are not."""
        return self.transform is not None

    @property
    def nbytes(self) -> int:
        """Bytes this rank's samples occupy in the object store."""
        return sum(block.nbytes for block in self.blocks)

    def _block(self, index: int) -> Any:
        if self._cached is None or self._cached[0] != index:
            self._cached = None  # drop the previous block before fetching the next
            import ray  # here: a one-worker run in the calling process never imports Ray

            self._cached = (index, ray.get(self.blocks[index].ref))
        return self._cached[1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cached": None}


def _offsets(ranges: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, int], int]]:
    offsets, position = [], 0
    for start, stop in ranges:
        offsets.append(((start, stop), position))
        position += stop - start
    return offsets


def ship_dataset(
    spec: DatasetSpec,
    rank_ranges: Sequence[Sequence[tuple[int, int]]],
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> list[ShippedData]:
    """Put every rank's samples in the object store; return one ``ShippedData`` per rank.

    Reads the dataset once, in order of each rank's ranges, holding one block in memory
    at a time.
    """
    data = spec.open()
    shipped = []
    plan = getattr(data, "plan_reads", None)
    for ranges in rank_ranges:
        if plan is not None:  # a shuffled order over costly reads: the rank's rows are read ahead
            plan(list(ranges))
        blocks: list[ShippedBlock] = []
        pending: list[tuple[int, int]] = []
        parts: list[Any] = []
        size = 0
        for start, stop in ranges:
            if start == stop:
                continue
            part = _read(data, start, stop)
            pending.append((start, stop))
            parts.append(part)
            size += _nbytes(part)
            if size >= block_bytes:
                blocks.append(_put(pending, parts))
                pending, parts, size = [], [], 0
        if pending:
            blocks.append(_put(pending, parts))
        shipped.append(ShippedData(blocks, spec.num_samples, spec.sample_shape, spec.transform))
    data.close()
    return shipped


def _read(data: CalibrationData, start: int, stop: int) -> Any:
    if isinstance(data, (ImageData, ShardData)):  # encoded bytes (image files, shard samples): the ranks decode
        return data.encoded(start, stop)
    if isinstance(data, ArrayData):
        return torch.from_numpy(data.load_compact(start, stop))
    return data.load(start, stop)


def _nbytes(part: Any) -> int:
    if isinstance(part, torch.Tensor):
        return part.numel() * part.element_size()
    return sum(len(data) for _, data in part)


def _put(ranges: list[tuple[int, int]], parts: list[Any]) -> ShippedBlock:
    if isinstance(parts[0], torch.Tensor):
        payload: Any = torch.cat(parts)
    else:
        payload = [item for part in parts for item in part]
    import ray

    return ShippedBlock(tuple(ranges), ray.put(payload), sum(_nbytes(part) for part in parts))
