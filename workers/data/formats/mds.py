"""MosaicML Streaming's MDS shards (``streaming.MDSWriter``), read in place, without Streaming.

A dataset written by ``MDSWriter(out=DIR, columns=...)`` is ``DIR/index.json`` (format
version 2) and its shards ``shard.00000.mds``, ... beside it; this module reads both as
Streaming lays them out (docs/data.md, "MosaicML Streaming (MDS)"): the index lists each shard
with its sample count and its columns (names sorted, encodings, fixed sizes); a shard is
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
last two kept), then as above; other codecs and unsafe encodings are refused, naming the shard.

The index also says each shard file's size and, where the writer was given ``hashes=``, its
digests (``raw_data`` for the shard, ``zip_data`` for its compressed file). Every shard's size
is checked against the index when the data is described, before any work; the digests
whenever a shard is read whole (every compressed shard, and its decompressed bytes), as
Streaming's own ``validate_hash`` does: so a changed or cut shard fails naming it, and a
flipped byte in a zstd shard (whose frames carry no checksum) does too once its digest is
listed. A shard's name may hold folders below the index (``merge_index``'s root index of
several streams lists ``SUBDIR/shard.00000.mds``), never ``..``.
"""

from __future__ import annotations

import bz2
import hashlib
import io
import json
import re
import tarfile
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bnrecal.errors import DatasetError, DatasetOptionError
from bnrecal.workers.data.storage.files import ShardRef
from bnrecal.workers.data.storage.reads import read_ranges

MDS_INDEX = "index.json"
"""The index Streaming writes beside its shards."""

MAX_INDEX_BYTES = 64 * 2**20

IMAGE_ENCODINGS = ("jpeg", "png", "pil")
"""Encodings whose cells are one image each."""

_INTEGERS = {"int": np.int64, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
             "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64}
"""Encodings that hold one integer (fixed size, little-endian), what a label column may be."""

DEFAULT_IMAGE_COLUMN = "image"
DEFAULT_LABEL_COLUMN = "label"

CODECS = ("gz", "bz2", "zstd")
"""Streaming's shard compressions read here (``zstd`` needs the ``zstandard`` package:
``bnrecal[mds]``); its ``br`` and ``snappy`` are refused."""

_SHARD_NAME = re.compile(r".+\.mds(\.[a-z0-9]+)?")
"""A shard's file name as MDSWriter writes it (``shard.00000.mds``, ``shard.00000.mds.zstd``)."""

MAX_SHARD_BYTES = 2**32
"""A shard's offsets are u32: no decompressed shard is larger."""


@dataclass(frozen=True)
class MdsColumns:
    """The columns every shard of a dataset has: names (in the index's order, which is the
    order of a sample's bytes), encodings, and fixed sizes (None: variable, a u32 size in
    each sample's head); and the codec every shard is compressed with (``CODECS``), None
    for shards written raw."""

    names: tuple[str, ...]
    encodings: tuple[str, ...]
    sizes: tuple[int | None, ...]
    compression: str | None = None

    def image_column(self, wanted: str | None, where: str) -> str:
        """The column holding the images: ``wanted``, else ``image``, else the only column
        of images (``jpeg``/``png``/``pil``); a miss names the columns and the option."""
        if wanted is not None and wanted in self.names:
            column = wanted
        elif wanted is None and DEFAULT_IMAGE_COLUMN in self.names:
            column = DEFAULT_IMAGE_COLUMN
        else:
            images = [n for n, e in zip(self.names, self.encodings) if e in IMAGE_ENCODINGS]
            if wanted is None and len(images) == 1:
                return images[0]
            missing = f"no image column {wanted!r}" if wanted is not None else f"no column {DEFAULT_IMAGE_COLUMN!r}"
            fix = (f"set image_column to the one holding the images (image columns: {', '.join(images)})" if images
                   else "set image_column to the column of encoded images")
            raise DatasetOptionError(f"{where} has {missing} (columns: {self._listed()}); {fix}", field="image_column")
        encoding = self.encodings[self.names.index(column)]
        if encoding not in (*IMAGE_ENCODINGS, "bytes"):
            raise DatasetOptionError(
                f"{where}: column {column!r} is {encoding}, not images (jpeg, png, pil, or bytes of an encoded image)",
                field="image_column",
            )
        return column

    def unlabelled(self, column: str, where: str) -> DatasetError | None:
        """Why ``column`` cannot give each sample's class (absent, not an integer), or None."""
        if column not in self.names:
            return DatasetOptionError(f"{where} has no label column {column!r} (columns: {self._listed()}); set "
                                      "label_column to its column of integer classes", field="label_column")
        encoding = self.encodings[self.names.index(column)]
        if encoding not in _INTEGERS:
            return DatasetOptionError(f"{where}: label column {column!r} is {encoding}, not integer classes "
                                      f"({', '.join(_INTEGERS)})", field="label_column")
        return None

    def cell(self, sample: bytes, column: str) -> bytes:
        """The bytes of ``column`` in one sample's bytes."""
        variable = [i for i, size in enumerate(self.sizes) if size is None]
        head = 4 * len(variable)
        if len(sample) < head:
            raise ValueError("sample shorter than its column sizes")
        sizes = list(self.sizes)
        for i, size in zip(variable, np.frombuffer(sample[:head], "<u4").tolist()):
            sizes[i] = int(size)
        wanted = self.names.index(column)
        start = head + sum(int(s or 0) for s in sizes[:wanted])
        end = start + int(sizes[wanted] or 0)
        if end > len(sample):
            raise ValueError("sample shorter than its columns")
        return sample[start:end]

    def _listed(self) -> str:
        return ", ".join(f"{n} ({e})" for n, e in zip(self.names, self.encodings))


HASHES = tuple(sorted(name for name in hashlib.algorithms_guaranteed if not name.startswith("shake_")))
"""Streaming's digests computed by ``hashlib``; its ``xxh*`` digests need the ``xxhash`` package."""


@dataclass(frozen=True)
class StoredFile:
    """What the index says one file of a shard holds: its size, and its digests by algorithm
    (empty unless ``MDSWriter(hashes=...)``)."""

    size: int
    hashes: tuple[tuple[str, str], ...] = ()

    def check(self, data: bytes, name: str) -> None:
        """Fail naming ``name`` unless ``data`` has this size and every listed digest."""
        if len(data) != self.size:
            raise DatasetError(f"{name} is corrupt: it holds {len(data)} bytes, its index says {self.size} "
                               "(it changed since the index was written)")
        for algorithm, expected in self.hashes:
            if _digest(algorithm, data, name) != expected:
                raise DatasetError(f"{name} is corrupt: its {algorithm} digest is not the one its index lists "
                                   "(its bytes changed since the index was written)")


@dataclass(frozen=True)
class MdsShard:
    """One shard the index lists: its file's name (below the index), its samples, and what its
    file holds (``packed``: the compressed file, None for a raw shard; ``raw``: the shard's bytes)."""

    basename: str
    count: int
    raw: StoredFile
    packed: StoredFile | None = None

    @property
    def stored(self) -> StoredFile:
        """What the file on disk or in the bucket holds."""
        return self.packed if self.packed is not None else self.raw


@dataclass(frozen=True)
class MdsIndex:
    """A dataset's ``index.json``: its shards (names, sample counts, sizes and digests) and their columns."""

    shards: tuple[MdsShard, ...]
    columns: MdsColumns
    where: str = field(default=MDS_INDEX, compare=False)  # what messages call the index (``ROLE: PATH``)

    @property
    def basenames(self) -> tuple[str, ...]:
        """Each shard's file name, below the index, in the index's order."""
        return tuple(shard.basename for shard in self.shards)

    @property
    def counts(self) -> tuple[int, ...]:
        """Each shard's samples."""
        return tuple(shard.count for shard in self.shards)

    def check_sizes(self, sizes: Sequence[int], names: Sequence[str]) -> None:
        """Fail naming the first shard whose file (of ``sizes`` bytes) is not the size the
        index says: changed, cut or grown since it was written."""
        for shard, size, name in zip(self.shards, sizes, names):
            if size != shard.stored.size:
                raise DatasetError(f"shard {name} is corrupt: it is {size} bytes, its index says {shard.stored.size} "
                                   "(it changed since the index was written)")


def is_mds_index(raw: bytes) -> bool:
    """Whether the bytes of an ``index.json`` are Streaming's (shards of format ``mds``)."""
    try:
        index = json.loads(raw)
    except ValueError:
        return False
    shards = index.get("shards") if isinstance(index, dict) else None
    return isinstance(shards, list) and bool(shards) and all(
        isinstance(s, dict) and s.get("format") == "mds" for s in shards)


def read_mds_index(raw: bytes, where: str) -> MdsIndex:
    """The shards and columns of Streaming's ``index.json`` (``where`` names it in errors);
    compressed shards, an unsafe encoding, or shards whose columns differ are refused."""
    try:
        index = json.loads(raw)
        shards = index["shards"]
        if index.get("version") != 2:
            raise DatasetError(f"{where}: index version {index.get('version')!r}; Streaming's version 2 is read")
        listed, layouts, codecs = [], set(), set()
        for shard in shards:
            name = shard["raw_data"]["basename"]
            codec = _codec(shard, name, where)
            if codec is not None:
                name = shard["zip_data"]["basename"]  # the file there is: the raw one is not written
            codecs.add(codec)
            if shard.get("version") != 2:
                raise DatasetError(f"{where}: shard {name} has version {shard.get('version')!r}; version 2 is read")
            parts = str(name).split("/")
            if not isinstance(name, str) or any(part in ("", ".", "..") for part in parts):
                raise DatasetError(f"{where}: shard name {name!r} is not a file below the index")
            raw = _stored(shard["raw_data"], name, where)
            packed = _stored(shard["zip_data"], name, where) if codec is not None else None
            listed.append(MdsShard(name, int(shard["samples"]), raw, packed))
            layouts.add((tuple(shard["column_names"]), tuple(shard["column_encodings"]),
                         tuple(None if s is None else int(s) for s in shard["column_sizes"])))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DatasetError(f"{where} is not a readable MosaicML Streaming index: {type(exc).__name__}: {exc}") from exc
    if not listed:
        raise DatasetError(f"{where} lists no shards")
    if len(layouts) > 1:
        raise DatasetError(f"{where}: the shards' columns differ; write every shard with the same columns")
    if len(codecs) > 1:
        raise DatasetError(f"{where}: the shards are compressed differently; write every shard with one compression")
    names, encodings, sizes = layouts.pop()
    if not len(names) == len(encodings) == len(sizes):
        raise DatasetError(f"{where}: column names, encodings and sizes do not match")
    unsafe = [n for n, e in zip(names, encodings) if e == "pkl"]
    if unsafe:
        raise DatasetError(f"{where}: column {unsafe[0]!r} is pickled (pkl), which is never read: it runs code")
    return MdsIndex(tuple(listed), MdsColumns(tuple(names), tuple(encodings), tuple(sizes), codecs.pop()), where)


def _stored(entry: dict, name: str, where: str) -> StoredFile:
    """A ``raw_data``/``zip_data`` entry: its size and digests (an algorithm Streaming does not
    write is refused: its digest could not be checked)."""
    hashes = entry.get("hashes") or {}
    for algorithm in hashes:
        if algorithm not in HASHES and not algorithm.startswith("xxh"):
            raise DatasetError(f"{where}: shard {name} lists a {algorithm!r} digest, which is not one Streaming writes")
    return StoredFile(int(entry["bytes"]), tuple(sorted((str(a), str(h)) for a, h in hashes.items())))


def _digest(algorithm: str, data: bytes, name: str) -> str:
    """The hex digest ``algorithm`` (as Streaming names it) of ``data``."""
    if algorithm in HASHES:
        return hashlib.new(algorithm, data).hexdigest()
    try:
        import xxhash
    except ImportError:
        raise DatasetError(f"{name}: its index lists a {algorithm} digest: pip install xxhash (or 'bnrecal[mds]') "
                           "to check it") from None
    if algorithm not in xxhash.algorithms_available:
        raise DatasetError(f"{name}: its index lists a {algorithm!r} digest, which xxhash does not compute")
    return getattr(xxhash, algorithm)(data).hexdigest()


def _codec(shard: dict, name: str, where: str) -> str | None:
    """The codec a shard is compressed with (``zstd`` of ``zstd:7``), None for a raw shard;
    one not read here is refused, naming the shard."""
    compression = shard.get("compression")
    if not compression and not shard.get("zip_data"):
        return None
    codec = str(compression or "").split(":")[0]
    if codec not in CODECS or not shard.get("zip_data"):
        raise DatasetError(f"{where}: shard {name} is compressed with {compression!r}, which is not read here "
                           f"(read: {', '.join(CODECS)}, or none); write it with MDSWriter(compression='zstd') or None")
    return codec


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

    def labels(self) -> np.ndarray:
        """Each sample's class (the label column's integer), reading the whole shard once
        (and so checking its digests)."""
        offsets = self._offset_table()
        body = self._whole()
        dtype = _INTEGERS[self.columns.encodings[self.columns.names.index(self.label_column)]]
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


def read_index_bytes(location: str, endpoint_url: str | None, where: str) -> bytes:
    """The bytes of an ``index.json`` at a local path or an ``s3://`` URI, at most
    :data:`MAX_INDEX_BYTES`."""
    from bnrecal.workers.data.storage.objectstore import RemoteSource, is_data_uri, remote_error

    try:
        if is_data_uri(location):
            remote = RemoteSource(location, endpoint_url)
            try:
                raw = bytes(remote.filesystem().cat_file(remote.key, start=0, end=MAX_INDEX_BYTES + 1))
            except Exception as exc:  # noqa: BLE001 - storage errors come in many types, all reported one way
                raise remote_error(exc, remote, where) from exc
        else:
            with open(location, "rb") as stream:
                raw = stream.read(MAX_INDEX_BYTES + 1)
    except OSError as exc:
        raise DatasetError(f"cannot read {where}: {exc.strerror or exc}") from exc
    if len(raw) > MAX_INDEX_BYTES:
        raise DatasetError(f"{where} is larger than {MAX_INDEX_BYTES} bytes")
    return raw


def is_mds_shard_name(name: str) -> bool:
    """Whether a file name (inside a tar) is an MDS shard's, compressed or not: a tar holding
    one is an uploaded MDS folder (an ``index.json`` alone says nothing: other data has them)."""
    return _SHARD_NAME.fullmatch(name.rsplit("/", 1)[-1]) is not None


def mds_in_tar(path: Path, shown: str) -> tuple[MdsIndex, list[ShardRef]]:
    """The MDS dataset in a plain tar of its folder (how one is uploaded): the index nearest
    the tar's top, read from the tar, and the shards it lists as byte ranges of the tar, read
    in place like a tar of shards, never unpacked."""
    with open(path, "rb") as stream:
        if stream.read(6).startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ")):
            raise DatasetError(f"{shown} is a compressed tar of MDS shards, which cannot be read in place; pack the "
                               "folder in a plain .tar (its shards may be compressed by MDSWriter)")
    members: dict[str, tarfile.TarInfo] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for info in tar:
                if info.isfile():
                    members[info.name.removeprefix("./")] = info
                tar.members.clear()
    except (tarfile.TarError, EOFError) as exc:
        raise DatasetError(f"{shown} is not a valid tar of MDS shards: {type(exc).__name__}: {exc}") from exc
    indexes = sorted((name.count("/"), name) for name in members if name.rsplit("/", 1)[-1] == MDS_INDEX)
    if not indexes:
        raise DatasetError(f"{shown} holds MDS shards but no {MDS_INDEX}; pack the folder MDSWriter wrote, index and all")
    if len(indexes) > 1 and indexes[0][0] == indexes[1][0]:
        raise DatasetError(f"{shown} holds several {MDS_INDEX} side by side ({indexes[0][1]}, {indexes[1][1]}); "
                           "pack one dataset, or merge their indexes (streaming's merge_index) into one above them")
    index_name = indexes[0][1]
    info = members[index_name]
    if info.size > MAX_INDEX_BYTES:
        raise DatasetError(f"{shown}:{index_name} is larger than {MAX_INDEX_BYTES} bytes")
    with open(path, "rb") as stream:
        stream.seek(info.offset_data)
        raw = stream.read(info.size)
    listed = read_mds_index(raw, f"{shown}:{index_name}")
    base = index_name.rsplit("/", 1)[0] + "/" if "/" in index_name else ""
    stat = path.stat()
    refs = []
    for basename in listed.basenames:
        member = members.get(base + basename)
        if member is None:
            raise DatasetError(f"{shown}:{index_name} lists shard {basename}, which the tar does not hold")
        refs.append(ShardRef(str(path), member.size, f"{stat.st_size}-{stat.st_mtime_ns}", f"{shown}:{base}{basename}",
                             member.offset_data))
    return listed, refs


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
