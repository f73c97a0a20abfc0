"""Array calibration data: ``.npy`` and ``.npz`` files, read row range by row range.

A local ``.npy`` file and an uncompressed ``.npz`` member (``np.savez``) are memory-mapped,
the latter at its byte offset inside the zip; in object storage they are read by byte
ranges of the requested rows. A compressed member (``np.savez_compressed``) cannot be mapped
nor read at an offset; it is streamed: the member is decompressed forward to the first
requested row and only the requested rows are kept. Nothing is ever loaded whole. Where the
rows lie comes from the file's header (``workers.data.formats.npy_layout``).
"""

from __future__ import annotations

import zipfile
import zlib
from dataclasses import dataclass, replace
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from bnrecal.workers.data.formats.archive import ZIP_MAGICS
from bnrecal.workers.data.formats.npy_layout import (
    NPY_MAGIC, ArrayLayout, compact_dtype, describe_layout, read_exact, skip_to,
)
from bnrecal.workers.data.opened import CalibrationData, Described, FileFormat, FormatDescription
from bnrecal.workers.data.integrity import verify_content_address
from bnrecal.workers.data.order import ReadAhead, Sampling, gather_runs
from bnrecal.workers.data.storage.files import Place
from bnrecal.workers.data.storage.objectstore import remote_error
from bnrecal.errors import DatasetError, DatasetOptionError

if TYPE_CHECKING:
    from bnrecal.workers.data.summary import DatasetSummary

GATHER_GAP_BYTES = 256 * 1024
"""Rows of a remote array closer than this are fetched in one ranged read, gap included:
a request costs about as much as that many bytes of transfer."""


class ArrayData(ReadAhead, CalibrationData):
    """Samples of a ``.npy``/``.npz`` array, converted to float32 as is (uint8 is not rescaled).

    ``place`` is where the file lies (:class:`~workers.data.storage.files.Place`): a local file
    is memory-mapped; an object in S3 is read by byte ranges of the requested rows only (rows
    close together in one ranged read, the runs of a step fetched concurrently); a compressed
    member is streamed forward from either. Files open lazily on the first ``load``; pickling
    drops them, so the object can cross process boundaries and reopen on the other side.
    ``order`` (``workers.data.order``) is the row of each sample position when the samples
    are not taken in file order. ``name`` is what errors call the file (the name the user
    knows), else the file's own name.
    """

    def __init__(
        self, place: Place, layout: ArrayLayout, num_samples: int, order: np.ndarray | None = None,
        name: str | None = None,
    ) -> None:
        self.place = place
        self.name = name or place.shown
        self.layout = layout
        self.num_samples = num_samples
        self.order = order
        self.sample_shape = tuple(layout.shape[1:])
        self._rows: np.ndarray | None = None  # memory map, for a local npy and npz-stored
        self._file: IO[bytes] | None = None  # the file a compressed member streams from
        self._zip: zipfile.ZipFile | None = None  # open archive, for npz-compressed
        self._stream: IO[bytes] | None = None
        self.plan_reads([])

    @property
    def _ranged(self) -> bool:
        """Whether rows are fetched by byte ranges (an uncompressed array in object storage)."""
        return self.place.remote is not None and self.layout.storage != "npz-compressed"

    def __len__(self) -> int:
        return self.num_samples

    @property
    def memory_map(self) -> np.memmap | None:
        """The memory map the rows are read from (None for a compressed npz member or an object)."""
        if self._ranged:
            return None
        self._open()
        return self._rows if isinstance(self._rows, np.memmap) else None

    def load(self, start: int, stop: int) -> torch.Tensor:
        """Copy rows ``[start, stop)`` (only those) to a float32 tensor."""
        rows = self.load_compact(start, stop)
        return torch.from_numpy(rows if rows.dtype == np.float32 else rows.astype(np.float32))

    def load_compact(self, start: int, stop: int) -> np.ndarray:
        """Samples ``[start, stop)`` in the smallest type that converts to the same float32
        values: the stored type when it is narrower than 4 bytes (uint8 images travel as
        uint8, a quarter of the bytes), float32 otherwise. With an ``order`` they are the rows
        at those positions of it, read in file order and put back in the order's."""
        self._check_range(start, stop)
        dtype = compact_dtype(self.layout.dtype)
        if start == stop:
            return np.empty((0, *self.sample_shape), dtype=dtype)
        if self.order is not None:
            ahead = self._planned_read(start, stop)
            return ahead if ahead is not None else self._gather(self.order[start:stop])
        return self._read_rows(start, stop)

    def _compact_row_bytes(self) -> int:
        return int(np.prod(self.sample_shape, dtype=np.int64)) * compact_dtype(self.layout.dtype).itemsize

    @property
    def _reads_ahead(self) -> bool:
        """Whether rows in a shuffled order are worth reading several steps at a time: a
        compressed member is one forward pass per read, a ranged read a round trip (a memory
        map needs no help)."""
        return self.layout.storage == "npz-compressed" or self._ranged

    def _read_rows(self, start: int, stop: int) -> np.ndarray:
        """Consecutive rows ``[start, stop)`` of the array, in the compact type."""
        dtype = compact_dtype(self.layout.dtype)
        if self._ranged:
            return self._fetch_runs([(start, stop)])[0]
        self._open()
        if self._rows is not None:
            return np.array(self._rows[start:stop], dtype=dtype, order="C")
        return np.array(self._read_compressed(start, stop), dtype=dtype)

    def _gather(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (any order, no repeats) in the compact type: a memory map reads them
        in one sorted fancy index, a compressed member in one forward pass over their runs, an
        object by its runs (rows up to ``GATHER_GAP_BYTES`` apart read through the gap) fetched
        concurrently in one call."""
        permutation = np.argsort(rows, kind="stable")
        ordered = rows[permutation]
        if self._ranged:
            gap = max(0, GATHER_GAP_BYTES // max(1, self._row_bytes()))
            found = gather_runs(ordered, None, gap, fetch=self._fetch_runs)
        else:
            self._open()
            if self._rows is not None:
                found = np.asarray(self._rows[ordered], dtype=compact_dtype(self.layout.dtype), order="C")
            else:
                found = gather_runs(ordered, lambda a, b: self._read_rows(a, b), 0)
        out = np.empty_like(found)
        out[permutation] = found
        return out

    def _row_bytes(self) -> int:
        return int(np.prod(self.sample_shape, dtype=np.int64)) * np.dtype(self.layout.dtype).itemsize

    def _fetch_runs(self, runs: list[tuple[int, int]]) -> list[np.ndarray]:
        """Each run of consecutive rows ``[start, stop)`` by its byte range, in the compact type."""
        stored, dtype, row_bytes = np.dtype(self.layout.dtype), compact_dtype(self.layout.dtype), self._row_bytes()
        offset = self.layout.data_offset
        raws = self.place.read_ranges([(offset + a * row_bytes, offset + b * row_bytes) for a, b in runs])
        return [
            np.array(np.frombuffer(raw, dtype=stored).reshape(b - a, *self.sample_shape), dtype=dtype, order="C")
            for (a, b), raw in zip(runs, raws)
        ]

    def _open(self) -> None:
        if self._rows is not None or self._stream is not None:
            return
        layout, name, path = self.layout, self.name, self.place.location
        if self.place.remote is None:
            verify_content_address(path)  # an uploaded blob: hashed before its first sample is read
        try:
            if layout.storage == "npz-compressed":
                self._file = self.place.open()
                self._zip = zipfile.ZipFile(self._file)
                self._stream = self._zip.open(layout.member or "")
            elif layout.storage == "npy":
                rows = np.load(path, mmap_mode="r", allow_pickle=False)
                if rows.shape != layout.shape or rows.dtype.str != layout.dtype:
                    raise DatasetError(f"{name} changed since it was described (shape {rows.shape})")
                self._rows = rows
            else:
                order = "F" if layout.fortran_order else "C"
                self._rows = np.memmap(
                    path, dtype=np.dtype(layout.dtype), mode="r",
                    offset=layout.data_offset, shape=layout.shape, order=order,
                )
        except DatasetError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - a local file's and an object's errors, reported one way
            self.close()
            remote = self.place.remote
            raise remote_error(exc, remote, "calibration data") if remote is not None else DatasetError(
                f"cannot open {name}: {exc}"
            ) from exc

    def _read_compressed(self, start: int, stop: int) -> np.ndarray:
        assert self._stream is not None
        dtype = np.dtype(self.layout.dtype)
        row_bytes = int(np.prod(self.sample_shape, dtype=np.int64)) * dtype.itemsize
        name = f"{self.name}:{self.layout.member}"
        try:
            skip_to(self._stream, self.layout.data_offset + start * row_bytes, name)
            raw = read_exact(self._stream, (stop - start) * row_bytes, name)
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
            raise DatasetError(f"{name} is corrupt: {exc}") from exc
        return np.frombuffer(raw, dtype=dtype).reshape(stop - start, *self.sample_shape)

    def close(self) -> None:
        """Drop the memory map and close the archive and its file."""
        if self._stream is not None:
            self._stream.close()
        if self._zip is not None:
            self._zip.close()
        if self._file is not None:
            self._file.close()
        self._rows = self._zip = self._stream = self._file = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_rows=None, _zip=None, _stream=None, _file=None, _window={})
        return state


LABEL_ARRAY = "y"
"""The ``.npz`` member holding one class index per sample of ``x``."""


@dataclass(frozen=True)
class ArrayPart:
    """An array file's part of a dataset's description: where its rows lie (``layout``)."""

    layout: ArrayLayout
    kind: ClassVar[str] = "array"

    def open(self, described: Described) -> ArrayData:
        """The array's rows, at the description's positions."""
        order = None if described.order == "given" else described.sample_rows()
        return ArrayData(described.place, self.layout, described.num_samples, order, name=described.display_name)

    def summarise(self, summary: DatasetSummary) -> DatasetSummary:
        """The storage (``npy``, ``npz-stored``, ``npz-compressed``), the dtype and the ``.npz`` member."""
        layout = self.layout
        return replace(summary, storage=layout.storage, dtype=layout.dtype, array=layout.array_name)

    def labels(self, described: Described) -> np.ndarray | None:
        """An ``.npz``'s integer array ``y``, one label per row of ``x``; None for a ``.npy`` or an
        ``.npz`` without ``y``. A ``y`` that does not fit ``x`` is an error, never ignored."""
        if not self.layout.storage.startswith("npz"):
            return None
        return _npz_labels(described)

    def same_samples(self) -> ArrayPart:
        """Itself: everything in it says where the samples lie."""
        return self


def _is_npy(head: bytes, path: Path) -> bool:
    return head.startswith(NPY_MAGIC)


def _is_npz(head: bytes, path: Path) -> bool:
    """A zip whose every member is a ``.npy`` (an npz is a zip, so it is tried before one)."""
    if not head.startswith(ZIP_MAGICS):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
    return bool(names) and all(name.endswith(".npy") for name in names)


NPY = FileFormat("npy", (".npy",), "arrays", _is_npy)
NPZ = FileFormat("npz", (".npz",), "arrays", _is_npz)


def describe_arrays(
    place: Place, data_format: str, size: int, transform: Mapping[str, Any] | None, sampling: Sampling,
    role: str, **npz_limits: Any,
) -> FormatDescription:
    """An ``.npy`` or ``.npz`` file or object (``data_format``, ``size`` bytes) described from
    its header alone: its rows are the samples (a transform, which only images take, and an
    empty array are refused, naming it); ``npz_limits`` bound a compressed member."""
    if transform:
        raise DatasetOptionError(f"transform applies to image data only; {place.shown} is an array file",
                                 field="transform")
    layout = describe_layout(place, data_format, size, role, **npz_limits)
    total = layout.shape[0]
    if total == 0:
        raise DatasetError(f"{place.shown} holds no samples (shape {layout.shape})")
    return FormatDescription(ArrayPart(layout), place.location, total, sampling.kept(total), tuple(layout.shape[1:]))


def _npz_labels(described: Described) -> np.ndarray | None:
    place, name, total = described.place, described.display_name, described.total_samples
    remote = place.remote
    try:
        stream = place.open()
    except Exception as exc:  # noqa: BLE001 - storage errors come in many types, all reported one way
        raise remote_error(exc, remote, "evaluation data") if remote is not None else DatasetError(
            f"{name}: cannot read labels {LABEL_ARRAY!r}: {exc}"
        ) from exc
    try:
        with stream, zipfile.ZipFile(stream) as archive:
            if f"{LABEL_ARRAY}.npy" not in archive.namelist():
                return None
            _check_label_size(archive.getinfo(f"{LABEL_ARRAY}.npy"), total, name)
            stream.seek(0)
            with np.load(stream, allow_pickle=False) as arrays:
                labels = arrays[LABEL_ARRAY]
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{name}: cannot read labels {LABEL_ARRAY!r}: {exc}") from exc
    if labels.shape != (total,):
        raise DatasetError(
            f"{name}: labels {LABEL_ARRAY!r} have shape {labels.shape}; expected one per sample, shape ({total},)"
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(f"{name}: labels {LABEL_ARRAY!r} must be integer class indices, not {labels.dtype}")
    labels = labels[described.sample_rows()].astype(np.int64)
    if labels.size and int(labels.min()) < 0:
        raise DatasetError(f"{name}: labels {LABEL_ARRAY!r} must be class indices >= 0, found {int(labels.min())}")
    return labels


_LABEL_HEADER_BYTES = 4096
"""More than any ``.npy`` header of a 1-D array takes (numpy pads them to 64 or 128 bytes)."""


def _check_label_size(info: zipfile.ZipInfo, samples: int, name: str) -> None:
    """Refuse a ``y`` member larger than one 8-byte integer per sample before it is loaded:
    ``y`` is read whole, and a compressed one could otherwise expand to any size."""
    bound = _LABEL_HEADER_BYTES + 8 * samples
    if info.file_size > bound:
        raise DatasetError(
            f"{name}: labels {LABEL_ARRAY!r} take {info.file_size} bytes, more than one integer for each of "
            f"the {samples} samples; refusing them"
        )
