"""Datasets of shards (WebDataset tars, Parquet, ``save_to_disk`` Arrow, MosaicML Streaming's
MDS), streamed: never unpacked, each rank reading only its own samples.

A sample's index is its position over all shards in sorted order (members in tar order, rows
in file order), so the same images give the same samples whether they come as a folder, tar
shards or Parquet, and the seeded order (:mod:`workers.data.order`) is a permutation of
samples, not of files: global batches do not depend on the number of ranks and every prefix
is a fair draw. A rank maps each of its positions to ``(shard, row)`` and reads the rows of a
call sorted by shard and offset (tar: one ranged read per member; Parquet: the row groups
they lie in; gzip and Arrow: one forward pass), then puts them back in the step's order.
Where a read is costly (object storage, gzip, Parquet row groups) and the order is
shuffled, the rows of the next steps (up to :data:`READ_AHEAD_BYTES` of encoded samples)
are read together, so a row group or a stretch of gzip is read once per window, not once
per step. Samples decode exactly as image files do (:func:`workers.data.formats.transform.load_image`);
``KEY.npy`` samples are arrays fed as they are.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from bnrecal.workers.data.opened import DecodedData, Described, ShardFormat, ShardReader, ShardSource
from bnrecal.workers.data.formats.npy_layout import NPY_MAGIC
from bnrecal.workers.data.order import READ_AHEAD_BYTES
from bnrecal.workers.data.shards.shard_formats import shard_format
from bnrecal.workers.data.storage.files import ShardRef
from bnrecal.workers.data.summary import DatasetSummary
from bnrecal.workers.data.formats.transform import ImageTransform, decode_image, normalize
from bnrecal.workers.data.formats.webdataset import NO_LABEL
from bnrecal.errors import DatasetError


@dataclass(frozen=True)
class ShardSet:
    """Everything a rank needs to read a dataset of shards: the shards in order, their
    sample counts (and Parquet row groups), the columns, and where indexes are cached."""

    format: str  # the name of one of workers.data.shards.shard_formats.SHARD_FORMATS
    shards: tuple[ShardRef, ...]
    counts: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...] = ()  # parquet/arrow: rows per row group (record batch) of each shard
    image_column: str | None = None
    label_column: str | None = None
    listing: Any = None  # the format's own index of the shards, read once when found (MDS: its MdsIndex)
    endpoint_url: str | None = None
    cache_root: str | None = None
    starts: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shard_format(self.format)  # a name no format has fails here, not in a rank
        object.__setattr__(self, "starts", np.cumsum([0, *self.counts]).astype(np.int64))

    @property
    def kind(self) -> ShardFormat:
        """The format of these shards: how a shard is opened, whether samples sit in columns."""
        return shard_format(self.format)

    @property
    def total(self) -> int:
        """Samples over all shards."""
        return int(self.starts[-1])

    @property
    def remote(self) -> bool:
        """Whether any shard lies in object storage."""
        return any(ref.remote for ref in self.shards)

    def reader(self, shard: int) -> ShardReader:
        """A reader of shard ``shard``, by its format (a tar's index comes from the cache, or is built)."""
        return self.kind.open(ShardSource(
            self.shards[shard], shard, "calibration data", self.groups[shard] if self.groups else (),
            self.image_column, self.label_column, self.listing, self.endpoint_url,
            Path(self.cache_root) if self.cache_root else None,
        ))

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard, row within the shard)`` of each global sample row."""
        shard = np.searchsorted(self.starts, rows, side="right") - 1
        return shard, rows - self.starts[shard]

    def summary(self, data: DatasetSummary) -> DatasetSummary:
        """``data``'s summary with the shards' format and count filled in, and the image
        column of shards with columns (a tar's samples have none)."""
        image_column = self.image_column if self.kind.columns else None
        return replace(data, format=self.format, shards=len(self.shards), image_column=image_column)


def decode_sample(name: str, data: bytes, transform: ImageTransform | None) -> torch.Tensor:
    """One sample from its encoded bytes: an ``.npy`` array as it is (float32), else an
    image decoded and transformed exactly as an image file is."""
    sample = decode_kept(name, data, transform)
    return normalize(sample, transform) if sample.dtype == torch.uint8 and transform is not None else sample


def kept_batch(samples: list[torch.Tensor], transform: ImageTransform | None) -> torch.Tensor:
    """Samples from :func:`decode_kept` as one batch: uint8 when all are image crops, else
    float32 as ``load`` gives them (an ``.npy`` sample among images is fed as it is)."""
    if transform is not None and any(sample.dtype != torch.uint8 for sample in samples):
        samples = [normalize(s, transform) if s.dtype == torch.uint8 else s for s in samples]
    return torch.stack(samples)


def from_kept_batch(kept: torch.Tensor, transform: ImageTransform | None) -> torch.Tensor:
    """A batch of :func:`kept_batch` as ``load`` gives it."""
    return normalize(kept, transform) if kept.dtype == torch.uint8 and transform is not None else kept


def decode_kept(name: str, data: bytes, transform: ImageTransform | None) -> torch.Tensor:
    """One sample from its encoded bytes in the form a rank keeps it: an ``.npy`` array as
    float32, an image as its uint8 crop (:func:`workers.data.formats.transform.decode_image`)."""
    if data[:6] == NPY_MAGIC:
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError as exc:
            raise DatasetError(f"cannot read array {name}: {exc}") from exc
        if array.dtype.kind not in "fiu":
            raise DatasetError(f"array {name} has dtype {array.dtype} (expected float or integer)")
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    if transform is None:
        raise DatasetError(f"sample {name} is not an .npy array, but the data's first sample was")
    return decode_image(io.BytesIO(data), name, transform)  # type: ignore[arg-type]


class ShardData(DecodedData):
    """The samples of a :class:`ShardSet` at the positions of ``order`` (global sample rows)."""

    def __init__(self, shards: ShardSet, order: np.ndarray, transform: ImageTransform | None,
                 sample_shape: tuple[int, ...], shuffled: bool) -> None:
        self.shards = shards
        self.order = np.asarray(order, dtype=np.int64)
        self.transform = transform
        self.sample_shape = tuple(sample_shape)
        self.shuffled = shuffled
        self._readers: dict[int, ShardReader] = {}
        self.plan_reads([])

    def __len__(self) -> int:
        return len(self.order)

    @property
    def decodes(self) -> bool:
        """Decoding is CPU-heavy: worth DataLoader workers."""
        return True

    def load_kept(self, start: int, stop: int) -> torch.Tensor:
        """Read and decode samples ``[start, stop)``: image crops as uint8 (``load`` normalises
        them); a broken sample raises a DatasetError naming its shard and member (or row)."""
        self._check_range(start, stop)
        if start == stop:
            return self._empty()
        samples = []
        for name, data in self.load_encoded(start, stop):
            sample = decode_kept(name, data, self.transform)
            if tuple(sample.shape) != self.sample_shape:
                raise DatasetError(f"sample {name} has shape {tuple(sample.shape)}, not {self.sample_shape} like the first")
            samples.append(sample)
        return kept_batch(samples, self.transform)

    def from_kept(self, kept: torch.Tensor) -> torch.Tensor:
        """Kept samples as ``load`` gives them."""
        return from_kept_batch(kept, self.transform)

    def encoded(self, start: int, stop: int) -> list[tuple[str, bytes]] | None:
        """The samples' encoded bytes, named ``shard:member`` (or row)."""
        self._check_range(start, stop)
        return self.load_encoded(start, stop) if stop > start else []

    def load_encoded(self, start: int, stop: int) -> list[tuple[str, bytes]]:
        """``(shard:member, encoded bytes)`` of samples ``[start, stop)``, in order (what the
        object-store transport ships: the ranks decode)."""
        planned = self._planned(start, stop)
        if planned is not None:
            return planned
        return self._fetch(self.order[start:stop])

    def plan_reads(self, ranges: list[tuple[int, int]]) -> None:
        """The ranges this reader will load, in order: with a shuffled order over costly reads
        (object storage, gzip, row groups), the rows of the next ones are read together.
        In a DataLoader worker, only the ranges that worker will load count."""
        self._plan = [(a, b) for a, b in ranges if b > a]
        self._window: dict[int, tuple[str, bytes]] = {}
        self._worker_plan: list[tuple[int, int]] | None = None
        self._planned_at: dict[tuple[int, int], int] = {}

    def _costly(self) -> bool:
        return self.shards.remote or not self.shards.kind.random_access or any(r.gzip for r in self.shards.shards)

    def _planned(self, start: int, stop: int) -> list[tuple[str, bytes]] | None:
        if not self.shuffled or not self._costly() or not self._plan:
            return None
        if self._worker_plan is None:
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            self._worker_plan = self._plan if info is None else self._plan[info.id :: info.num_workers]
            self._planned_at = {r: i for i, r in enumerate(self._worker_plan)}
        plan = self._worker_plan
        if (start, stop) not in self._planned_at:
            return None
        rows = self.order[start:stop].tolist()
        if any(row not in self._window for row in rows):
            self._read_ahead(plan, self._planned_at[(start, stop)])
        return [self._window.pop(row) for row in rows]

    def _read_ahead(self, plan: list[tuple[int, int]], first: int) -> None:
        wanted: list[np.ndarray] = []
        size = 0
        for a, b in plan[first:]:
            rows = self.order[a:b]
            cost = self._encoded_bytes(rows)
            if wanted and size + cost > READ_AHEAD_BYTES:
                break
            wanted.append(rows)
            size += cost
        rows = np.unique(np.concatenate(wanted))
        self._window = dict(zip(rows.tolist(), self._fetch(rows)))

    def _encoded_bytes(self, rows: np.ndarray) -> int:
        """About how many bytes these rows' samples take encoded (as each shard's reader says)."""
        shard, local = self.shards.locate(rows)
        return sum(self._reader(s).encoded_bytes(local[shard == s]) for s in np.unique(shard).tolist())

    def _fetch(self, rows: np.ndarray) -> list[tuple[str, bytes]]:
        """The encoded samples at global ``rows`` (any order), read shard by shard in file order."""
        shard, local = self.shards.locate(rows)
        out: list[Any] = [None] * len(rows)
        for s in np.unique(shard).tolist():
            where = np.flatnonzero(shard == s)
            ordered = where[np.argsort(local[where], kind="stable")]
            reader = self._reader(s)
            wanted = [int(r) for r in local[ordered]]
            unique = sorted(set(wanted))
            found = reader.read(unique)
            by_row = dict(zip(unique, found))
            name = self.shards.shards[s].name
            for position, row in zip(ordered.tolist(), wanted):
                member, data = by_row[row]
                out[position] = (f"{name}:{member}", data)
        return out

    def _reader(self, shard: int) -> ShardReader:
        if shard not in self._readers:
            self._readers[shard] = self.shards.reader(shard)
        return self._readers[shard]

    def close(self) -> None:
        """Close the shards' open files and streams."""
        for reader in self._readers.values():
            reader.close()
        self._readers = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_readers": {}, "_window": {}, "_worker_plan": None, "_planned_at": {}}


def shard_labels(shards: ShardSet, rows: np.ndarray, role: str = "evaluation data") -> np.ndarray:
    """The class of each sample at global ``rows``; a sample without one fails naming the
    ``KEY.cls`` member or the column it lacks."""
    labels = []
    for s in range(len(shards.shards)):
        reader = shards.reader(s)
        try:
            unlabelled = reader.unlabelled(role)
            values = reader.labels() if unlabelled is None else None
        finally:
            reader.close()
        if unlabelled is not None:
            raise unlabelled
        assert values is not None
        if len(values) != shards.counts[s]:
            raise DatasetError(f"{role}: shard {shards.shards[s].name} changed since it was described")
        labels.append(values)
    everything = np.concatenate(labels).astype(np.int64)
    assert not (everything == NO_LABEL).any()
    return everything[rows]


@dataclass(frozen=True)
class ShardPart:
    """A dataset of shards' part of its description: the shards (:class:`ShardSet`) and the
    resolved ``transform`` of their images (None: the samples are ``.npy`` arrays)."""

    shards: ShardSet
    transform: ImageTransform | None
    kind: ClassVar[str] = "shards"

    def open(self, described: Described) -> ShardData:
        """The shards' samples at the description's positions, streamed."""
        return ShardData(
            self.shards, described.sample_rows(), self.transform, described.sample_shape, described.order == "shuffled"
        )

    def summarise(self, summary: DatasetSummary) -> DatasetSummary:
        """The transform of image samples, the shards' format and count, and a column's name."""
        if self.transform is not None:
            summary = replace(summary, transform=self.transform, classes=0)
        return self.shards.summary(summary)

    def labels(self, described: Described) -> np.ndarray:
        """Each sample's ``KEY.cls`` or label column: every sample must have one."""
        return shard_labels(self.shards, described.sample_rows())

    def same_samples(self) -> ShardPart:
        """Without the label column: it does not change the samples."""
        return replace(self, shards=replace(self.shards, label_column=None))
