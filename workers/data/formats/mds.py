"""MosaicML Streaming's MDS shards (``streaming.MDSWriter``), read in place, without Streaming.

What the index says is :mod:`workers.data.formats.mds_index`; this module reads a shard's
samples as Streaming lays them out (docs/data.md, "MosaicML Streaming (MDS)"): a shard is
``[samples: u32][offsets: u32 x (samples + 1)]`` then the samples, sample ``i`` the bytes
``[offsets[i], offsets[i + 1])``: the sizes (u32) of its variable-size columns, then every
column's bytes in the index's column order. So a rank reads only its own samples: the
offset table once per shard, then one ranged read per sample (local ``pread``, S3 range
GETs, as for tar shards).

The images are the ``image`` column (or the one column of images: ``jpeg``, ``png``,
``pil``, or ``bytes`` holding an encoded image), set by ``image_column``; ``jpeg`` and
``png`` cells are the encoded file and decode as that file does, a ``pil`` cell (raw
pixels) is handed on as a lossless PNG of those pixels, so the same images give the same
statistics as a folder of them. Labels are the ``label`` column (``label_column``), an
integer encoding. Shards written with ``compression=`` (``gz``, ``bz2`` or ``zstd``, as
``shard.00000.mds.zstd``) are read whole once a rank needs one, decompressed in memory (the
last two kept), then as above. A shard read whole (every compressed one, a raw one for its
labels) is checked against the index's size and digests: a changed or cut shard fails
naming it, and so does a flipped byte in a zstd shard (whose frames carry no checksum) once
its digest is listed. :data:`MDS` is how the shards' room finds them (by their index), counts and opens one, from
the index read once when the shards were found.
"""

from __future__ import annotations

import bz2
import io
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from bnrecal.errors import DatasetError
from bnrecal.workers.data.formats.mds_index import (
    DEFAULT_LABEL_COLUMN, INTEGER_ENCODINGS, MAX_INDEX_BYTES, MDS_INDEX, MdsColumns, MdsIndex, MdsShard, is_mds_index,
    is_mds_shard_name, mds_in_tar, read_mds_index,
)
from bnrecal.workers.data.opened import FoundShards, ShardCandidate, ShardCount, ShardFormat, ShardSource
from bnrecal.workers.data.storage.files import ShardRef
from bnrecal.workers.data.storage.reads import read_ranges

MAX_SHARD_BYTES = 2**32
"""A shard's offsets are u32: no decompressed shard is larger."""


class MdsReader:
    """Samples of one MDS shard: the image cells of the rows asked for, and the labels."""

    def __init__(self, ref: ShardRef, columns: MdsColumns, shard: MdsShard, image_column: str,
                 label_column: str | None, endpoint_url: str | None) -> None:
        self.ref, self.columns, self.shard, self.count = ref, columns, shard, shard.count
        self.image_column, self.label_column = image_column, label_column or DEFAULT_LABEL_COLUMN
        self.endpoint_url = endpoint_url
        self._offsets: np.ndarray | None = None

    def read(self, rows: Sequence[int]) -> list[tuple[str, bytes]]:
        """``(row, encoded image)`` of each sample at ``rows`` (ascending)."""
        offsets = self._offset_table()
        ranges = [(int(offsets[r]), int(offsets[r + 1])) for r in rows]
        encoding = self.columns.encodings[self.columns.names.index(self.image_column)]
        out = []
        for row, sample in zip(rows, self._ranges(ranges)):
            try:
                cell = self.columns.cell(sample, self.image_column)
            except ValueError as exc:
                raise DatasetError(f"shard {self.ref.name} is corrupt at sample {row}: {exc}") from exc
            out.append((str(row), _pil_as_png(cell, f"{self.ref.name}:{row}") if encoding == "pil" else cell))
        return out

    def encoded_bytes(self, rows: np.ndarray) -> int:
        """A guess of these rows' encoded bytes (128 KiB a row: the offsets are not read for it)."""
        return len(rows) * 128 * 1024

    def labels(self) -> np.ndarray:
        """Each sample's class (the label column's integer), reading the whole shard once
        (and so checking its digests)."""
        offsets = self._offset_table()
        body = self._whole()
        dtype = INTEGER_ENCODINGS[self.columns.encodings[self.columns.names.index(self.label_column)]]
        values = []
        for row in range(self.count):
            try:
                cell = self.columns.cell(body[int(offsets[row]):int(offsets[row + 1])], self.label_column)
            except ValueError as exc:
                raise DatasetError(f"shard {self.ref.name} is corrupt at sample {row}: {exc}") from exc
            values.append(int(np.frombuffer(cell, np.dtype(dtype).newbyteorder("<"))[0]))
        labels = np.asarray(values, np.int64)
        if len(labels) and labels.min() < 0:
            raise DatasetError(f"{self.ref.name}: label column {self.label_column!r} holds {int(labels.min())}; "
                               "classes are >= 0")
        return labels

    def unlabelled(self, role: str) -> DatasetError | None:
        """Why evaluation cannot read this shard's labels (no integer label column), or None."""
        return self.columns.unlabelled(self.label_column, f"{role}: {self.ref.name}")

    def close(self) -> None:
        """Nothing stays open between reads."""

    def _offset_table(self) -> np.ndarray:
        """The shard's sample offsets, read once; a count other than the index's means the shard changed."""
        if self._offsets is None:
            (raw,) = self._ranges([(0, 4 * (self.count + 2))])
            if len(raw) < 4 * (self.count + 2):
                raise DatasetError(f"shard {self.ref.name} is corrupt: shorter than its offset table")
            table = np.frombuffer(raw, "<u4").astype(np.int64)
            if int(table[0]) != self.count:
                raise DatasetError(f"shard {self.ref.name} holds {int(table[0])} samples, its index says {self.count} "
                                   "(it changed since the index was written)")
            offsets = table[1:]
            size = self.ref.size if self.columns.compression is None else len(self._inflated())
            if (np.diff(offsets) < 0).any() or int(offsets[-1]) > size:
                raise DatasetError(f"shard {self.ref.name} is corrupt: its offsets run past its {size} bytes")
            self._offsets = offsets
        return self._offsets

    def _whole(self) -> bytes:
        """The shard's bytes, whole, checked against the index's size and digests."""
        if self.columns.compression is not None:
            return self._inflated()
        (body,) = read_ranges(self.ref, [(0, self.ref.size)], self.endpoint_url)
        self.shard.raw.check(body, f"shard {self.ref.name}")
        return body

    def _ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of the shard's ``[start, end)`` ranges: ranged reads of a raw shard, slices
        of a compressed one's decompressed bytes."""
        if self.columns.compression is None:
            return read_ranges(self.ref, ranges, self.endpoint_url)
        body = self._inflated()
        return [body[start:end] for start, end in ranges]

    def _inflated(self) -> bytes:
        """A compressed shard's bytes, decompressed: the whole file read once, the last two
        shards any reader of this process decompressed kept (a rank reads its rows shard by shard);
        the file and its decompressed bytes are checked against the index's sizes and digests."""
        key = (self.ref.location, self.ref.offset, self.ref.size, self.ref.version)
        with _INFLATED_LOCK:
            if key in _INFLATED:
                _INFLATED.move_to_end(key)
                return _INFLATED[key]
        (packed,) = read_ranges(self.ref, [(0, self.ref.size)], self.endpoint_url)
        assert self.columns.compression is not None and self.shard.packed is not None
        name = f"shard {self.ref.name}"
        self.shard.packed.check(packed, name)
        body = inflate(self.columns.compression, packed, name)
        self.shard.raw.check(body, name)
        with _INFLATED_LOCK:
            _INFLATED[key] = body
            while len(_INFLATED) > 2:
                _INFLATED.popitem(last=False)
        return body


_INFLATED: OrderedDict[tuple[str, int, int, str], bytes] = OrderedDict()
_INFLATED_LOCK = threading.Lock()


def inflate(codec: str, packed: bytes, name: str) -> bytes:
    """``packed`` decompressed by ``codec`` (``CODECS``), at most :data:`MAX_SHARD_BYTES`;
    bytes that do not decompress, or decompress past that, fail naming ``name``."""
    try:
        if codec == "gz":
            body = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(packed, MAX_SHARD_BYTES + 1)
        elif codec == "bz2":
            body = bz2.BZ2Decompressor().decompress(packed, max_length=MAX_SHARD_BYTES + 1)
        else:
            body = _unzstd(packed, name)
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise DatasetError(f"{name} is corrupt: it does not decompress ({codec}): {exc}") from exc
    if len(body) > MAX_SHARD_BYTES:
        raise DatasetError(f"{name} decompresses past {MAX_SHARD_BYTES} bytes, more than a shard can hold")
    return body


def _pil_as_png(cell: bytes, name: str) -> bytes:
    """A ``pil`` cell (``[width][height][mode size][mode][raw pixels]``) as a lossless PNG of
    its pixels in RGB, so it decodes as an image file does."""
    from PIL import Image

    from bnrecal.workers.data.formats.transform import to_rgb

    try:
        width, height, mode_size = np.frombuffer(cell[:12], "<u4").tolist()
        mode = cell[12:12 + mode_size].decode("utf-8")
        image = Image.frombytes(mode, (width, height), cell[12 + mode_size:])
    except (ValueError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot decode image {name}: {exc}") from exc
    out = io.BytesIO()
    to_rgb(image).save(out, format="PNG", compress_level=0)
    return out.getvalue()


def _unzstd(packed: bytes, name: str) -> bytes:
    """A zstd frame decompressed (``zstandard``, where installed), at most one byte past the limit."""
    try:
        import zstandard
    except ImportError:
        raise DatasetError(f"{name} is compressed with zstd: pip install zstandard (or 'bnrecal[mds]') "
                           "to read it") from None
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(packed)) as stream:
            return stream.read(MAX_SHARD_BYTES + 1)
    except zstandard.ZstdError as exc:
        raise DatasetError(f"{name} is corrupt: it does not decompress (zstd): {exc}") from exc


def _listing(source: ShardSource) -> MdsIndex:
    listing = source.listing
    assert isinstance(listing, MdsIndex), "MDS shards are described from the index that listed them"
    return listing


def _count(source: ShardSource) -> ShardCount:
    """A shard's samples and the image column, as the index says (nothing is read)."""
    listing = _listing(source)
    return ShardCount(listing.shards[source.position].count, image_column=listing.columns.image_column(
        source.image_column, listing.where))


def _open(source: ShardSource) -> MdsReader:
    """A rank's reader of an MDS shard, by its entry in the index."""
    listing = _listing(source)
    assert source.image_column is not None
    return MdsReader(source.ref, listing.columns, listing.shards[source.position], source.image_column,
                     source.label_column, source.endpoint_url)


def _find(candidate: ShardCandidate) -> FoundShards | None:
    """The shards a Streaming ``index.json`` lists, in its order: a folder (or prefix) holding
    one, the file itself, or (on disk) a plain tar of such a folder holding MDS shards (an
    upload); each shard the size the index says (one changed or cut since is refused here,
    before any work). Another ``index.json`` is not MDS's."""
    if candidate.is_folder:
        if not candidate.has(MDS_INDEX):
            return None
        return _indexed(candidate, MDS_INDEX, f"{candidate.shown.rstrip('/')}/{MDS_INDEX}")
    if candidate.file_name.lower() == MDS_INDEX:
        return _indexed(candidate, None, candidate.shown)
    if candidate.local is not None and any(is_mds_shard_name(name) for name in candidate.tar_members()):
        return _checked(*mds_in_tar(candidate.local, candidate.shown))
    return None


def _indexed(candidate: ShardCandidate, name: str | None, shown: str) -> FoundShards | None:
    where = f"{candidate.role}: {shown}"
    raw = candidate.read(name, MAX_INDEX_BYTES + 1)
    if len(raw) > MAX_INDEX_BYTES:
        raise DatasetError(f"{where} is larger than {MAX_INDEX_BYTES} bytes")
    if not is_mds_index(raw):
        return None
    listed = read_mds_index(raw, where)
    return _checked(listed, candidate.refs(listed.basenames, where))


def _checked(listed: MdsIndex, refs: list[ShardRef]) -> FoundShards:
    listed.check_sizes([ref.size for ref in refs], [ref.name for ref in refs])
    return FoundShards("mds", refs, listed)


MDS = ShardFormat("mds", "MDS", columns=True, random_access=True, count=_count, open=_open, find=_find)
"""MosaicML Streaming's shards: columns, a local raw shard's samples read by range in any order."""
