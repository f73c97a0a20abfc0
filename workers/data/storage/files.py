"""A file, or a byte range of one, wherever it lies: on this machine or in object storage.

:class:`ShardRef` names one shard of a dataset (or any file read by ranges: an MDS shard, an
uploaded tar's member); :class:`Place` is where a dataset's own bytes live (an array file, an
image folder, or their objects and prefixes in S3), so one reader serves both, reading
through it (``docs/data.md``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from bnrecal.workers.data.storage.objectstore import RemoteSource, is_data_uri, open_remote_file, remote_error
from bnrecal.errors import DatasetError

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
PARQUET_SUFFIXES = (".parquet",)
SHARD_SUFFIXES = TAR_SUFFIXES + PARQUET_SUFFIXES


@dataclass(frozen=True)
class ShardRef:
    """One shard: ``location`` (an absolute local path or an ``s3://`` URI), the byte range
    ``[offset, offset + size)`` of it that is the shard (the whole file unless it lies inside
    another tar), ``version`` (``size-mtime_ns`` or the ETag) and ``name``, what messages call it."""

    location: str
    size: int
    version: str
    name: str
    offset: int = 0

    @property
    def remote(self) -> bool:
        """Whether the shard lies in object storage."""
        return is_data_uri(self.location)

    @property
    def suffix(self) -> str:
        """The shard's format suffix (``.tar``, ``.tar.gz``, ``.parquet``, ...), from its name."""
        lower = self.name.lower()
        return next((s for s in SHARD_SUFFIXES if lower.endswith(s)), "")

    @property
    def gzip(self) -> bool:
        """Whether the shard is a gzip-compressed tar (read forward only)."""
        return self.suffix in (".tar.gz", ".tgz")

    @property
    def cache_key(self) -> str:
        """What the index cache is keyed by: where the shard lies and which version it is."""
        text = f"{self.location}\0{self.offset}\0{self.size}\0{self.version}"
        return hashlib.sha256(text.encode()).hexdigest()


def is_shard_name(name: str) -> bool:
    """Whether a file name is a shard's (``.tar``, ``.tar.gz``/``.tgz``, ``.parquet``)."""
    return name.lower().endswith(SHARD_SUFFIXES)


def local_ref(path: Path, name: str) -> ShardRef:
    """The :class:`ShardRef` of a local shard file."""
    stat = path.stat()
    return ShardRef(str(path), stat.st_size, f"{stat.st_size}-{stat.st_mtime_ns}", name)



@dataclass(frozen=True)
class Place:
    """Where a dataset's own bytes live: ``location``, an absolute local path (a file or a
    folder) or an ``s3://`` URI (an object or a prefix), and the endpoint that reaches it (None:
    the AWS environment's own). Picklable: a reader carries it to the ranks, and reads every
    file through it, so one reader serves a local folder and an S3 prefix alike."""

    location: str
    endpoint_url: str | None = None
    name: str | None = None  # what messages call it (a shard's name), else its URI or file name

    @property
    def remote(self) -> RemoteSource | None:
        """The object or prefix in object storage; None for a local path."""
        return RemoteSource(self.location, self.endpoint_url) if is_data_uri(self.location) else None

    def open(self) -> IO[bytes]:
        """The file, seekable and read-only (an object reads ahead by 1 MiB)."""
        remote = self.remote
        return open(self.location, "rb") if remote is None else open_remote_file(remote)

    def read_ranges(self, ranges: Sequence[tuple[int, int]], role: str = "calibration data") -> list[bytes]:
        """The byte ranges ``[start, end)`` of the file, an object's fetched concurrently in one
        call; a short read (the file changed since it was described) is an error."""
        parts = self.fetch_ranges(ranges, role)
        for (start, end), part in zip(ranges, parts):
            if len(part) != end - start:
                raise DatasetError(f"{self.shown} changed since it was described (short read)")
        return parts

    def fetch_ranges(self, ranges: Sequence[tuple[int, int]], role: str = "calibration data", gap: int = 0) -> list[bytes]:
        """The byte ranges ``[start, end)`` as read, short where the file ends early (the caller
        says what that means): a local file ``pread`` each; an object's ranges (those at most
        ``gap`` bytes apart fetched as one) in one batch of concurrent range GETs."""
        if not ranges:
            return []
        remote = self.remote
        if remote is None:
            try:
                fd = os.open(self.location, os.O_RDONLY)
            except OSError as exc:
                raise self._error(exc, role) from exc
            try:
                return [os.pread(fd, end - start, start) for start, end in ranges]
            finally:
                os.close(fd)
        order = sorted(range(len(ranges)), key=lambda i: ranges[i])
        merged: list[list[int]] = []  # [start, end, first index into order, last]
        for position, i in enumerate(order):
            start, end = ranges[i]
            if merged and start - merged[-1][1] <= gap:
                merged[-1][1] = max(merged[-1][1], end)
                merged[-1][3] = position
            else:
                merged.append([start, end, position, position])
        try:
            fs = remote.filesystem()
            if len(merged) == 1:
                blobs: list[Any] = [fs.cat_file(remote.key, start=merged[0][0], end=merged[0][1])]
            else:
                blobs = fs.cat_ranges([remote.key] * len(merged), [m[0] for m in merged], [m[1] for m in merged])
        except Exception as exc:  # noqa: BLE001 - storage errors come in many types, all reported one way
            raise self._error(exc, role) from exc
        out: list[bytes] = [b""] * len(ranges)
        for (start, _, first, last), blob in zip(merged, blobs):
            if isinstance(blob, BaseException):
                raise self._error(blob, role) from blob
            for position in range(first, last + 1):
                i = order[position]
                a, b = ranges[i]
                out[i] = bytes(blob[a - start : b - start])
        return out

    def read_files(self, names: Sequence[str], role: str = "calibration data") -> list[bytes]:
        """The whole files ``names`` (relative POSIX paths) under this folder or prefix, in
        order; an object store's fetched concurrently in one call."""
        remote = self.remote
        if remote is None:
            root = Path(self.location)
            try:
                return [(root / name).read_bytes() for name in names]
            except OSError as exc:
                raise DatasetError(f"cannot read image {exc.filename and Path(exc.filename).name}: {exc.strerror}") from exc
        paths = [f"{remote.key}/{name}" for name in names]
        if not paths:
            return []
        try:
            fetched = remote.filesystem().cat(paths, on_error="raise")
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, role) from exc
        return [fetched[path] for path in paths]

    @property
    def shown(self) -> str:
        """What messages call it: its ``name``, else the URI or the local file's or folder's name."""
        return self.name or (self.location if self.remote is not None else Path(self.location).name)

    def _error(self, exc: BaseException, role: str) -> DatasetError:
        remote = self.remote
        if remote is not None:
            return remote_error(exc, remote, role)
        if isinstance(exc, DatasetError):
            return exc
        return DatasetError(f"cannot read {self.shown}: {getattr(exc, 'strerror', None) or exc}")
