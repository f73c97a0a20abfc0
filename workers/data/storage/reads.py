"""Bytes of a shard: ranged reads (a local ``pread``, concurrent S3 range GETs) and forward
streams (gzip shards, Arrow files), each over the byte range of its file that is the shard.

Every read goes through here, so what a rank fetches is exactly its own samples' bytes (plus
the 512-byte tar header before each member, which checks that the shard is still the one
that was indexed) and nothing else is read into memory whole.
"""

from __future__ import annotations

import io
import os
from typing import IO, Any

from bnrecal.workers.data.storage.objectstore import RemoteSource, remote_error
from bnrecal.workers.data.storage.files import Place, ShardRef
from bnrecal.errors import DatasetError

GATHER_GAP_BYTES = 256 * 1024
"""Members of a remote shard closer than this are fetched in one ranged request."""
STREAM_BLOCK = 8 * 2**20


class SliceFile(io.RawIOBase):
    """A read-only, seekable view of ``[offset, offset + size)`` of a file: a shard inside an
    uploaded tar of shards reads as if it were its own file."""

    def __init__(self, raw: IO[bytes], offset: int, size: int) -> None:
        self._raw = raw
        self._offset = offset
        self._size = size
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + position)
        return self._position

    def readinto(self, buffer: Any) -> int:
        left = self._size - self._position
        if left <= 0:
            return 0
        view = memoryview(buffer)[: min(len(buffer), left)]
        self._raw.seek(self._offset + self._position)
        count = self._raw.readinto(view)  # type: ignore[attr-defined]
        self._position += count or 0
        return count or 0

    def close(self) -> None:
        self._raw.close()
        super().close()


def open_shard(ref: ShardRef, endpoint_url: str | None, role: str = "calibration data") -> IO[bytes]:
    """A seekable binary file of the shard (a local file, or an S3 object read in large
    sequential blocks), limited to the shard's byte range."""
    try:
        if ref.remote:
            source = RemoteSource(ref.location, endpoint_url)
            raw: IO[bytes] = source.filesystem().open(source.key, "rb", block_size=STREAM_BLOCK, cache_type="readahead")
        else:
            raw = open(ref.location, "rb")  # noqa: SIM115 - closed by the caller
    except Exception as exc:  # noqa: BLE001 - storage errors come in many types, all reported one way
        raise _error(exc, ref, endpoint_url, role) from exc
    if ref.offset == 0 and not ref.remote and ref.size == os.fstat(raw.fileno()).st_size:
        return raw
    return io.BufferedReader(SliceFile(raw, ref.offset, ref.size), buffer_size=1 << 20)


def open_random_access(ref: ShardRef, endpoint_url: str | None, role: str = "calibration data") -> IO[bytes]:
    """A seekable file of the shard for readers that seek to what they need (Parquet footers
    and column chunks): on S3 every read is its own ranged request, nothing read ahead."""
    if not ref.remote:
        return open_shard(ref, endpoint_url, role)
    source = RemoteSource(ref.location, endpoint_url)
    try:
        raw = source.filesystem().open(source.key, "rb", cache_type="none")
    except Exception as exc:  # noqa: BLE001
        raise _error(exc, ref, endpoint_url, role) from exc
    return raw if ref.offset == 0 else io.BufferedReader(SliceFile(raw, ref.offset, ref.size))


def read_ranges(ref: ShardRef, ranges: list[tuple[int, int]], endpoint_url: str | None) -> list[bytes]:
    """The bytes ``[start, end)`` of the shard for each range (shard-relative offsets), read
    through its :class:`Place`: local ``pread`` each, or on S3 the ranges (those closer than
    :data:`GATHER_GAP_BYTES` merged) fetched concurrently in one batch of range GETs. A short
    read means the shard changed."""
    place = Place(ref.location, endpoint_url, f"shard {ref.name}")
    out = place.fetch_ranges([(ref.offset + a, ref.offset + b) for a, b in ranges], gap=GATHER_GAP_BYTES)
    for (start, end), data in zip(ranges, out):
        if len(data) != end - start:
            raise DatasetError(f"shard {ref.name} is shorter than when it was indexed (it changed or is truncated)")
    return out


def _error(exc: BaseException, ref: ShardRef, endpoint_url: str | None, role: str) -> DatasetError:
    if ref.remote:
        return remote_error(exc, RemoteSource(ref.location, endpoint_url), role)
    return DatasetError(f"cannot read shard {ref.name}: {getattr(exc, 'strerror', None) or exc}")
