"""What a MosaicML Streaming dataset (``streaming.MDSWriter``) says of itself: its
``index.json``, read without Streaming (docs/data.md, "MosaicML Streaming (MDS)").

A dataset written by ``MDSWriter(out=DIR, columns=...)`` is ``DIR/index.json`` (format
version 2) and its shards ``shard.00000.mds``, ... below it. The index lists each shard with
its sample count, its columns (names sorted, encodings, fixed sizes), its compression, and
its file's size and, where the writer was given ``hashes=``, its digests (``raw_data`` for
the shard, ``zip_data`` for its compressed file): :class:`MdsIndex`, read once when the data
is detected. Every shard's size is checked against it when the data is described, before any
work; the digests whenever a shard is read whole (:mod:`workers.data.formats.mds`). A shard's
name may hold folders below the index (``merge_index``'s root index over several parts lists
``PART/shard.00000.mds``), never ``..``. A plain tar of such a folder (an upload) is read in
place: its index from the tar, its shards byte ranges of it (:func:`mds_in_tar`). Compressions
other than ``gz``, ``bz2`` and ``zstd``, pickled columns and digests of unknown algorithms are
refused, naming the index.
"""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bnrecal.errors import DatasetError, DatasetOptionError
from bnrecal.workers.data.storage.files import ShardRef

MDS_INDEX = "index.json"
"""The index Streaming writes beside its shards."""

MAX_INDEX_BYTES = 64 * 2**20

IMAGE_ENCODINGS = ("jpeg", "png", "pil")
"""Encodings whose cells are one image each."""

INTEGER_ENCODINGS = {"int": np.int64, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
             "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64}
"""Encodings that hold one integer (fixed size, little-endian), what a label column may be."""

DEFAULT_IMAGE_COLUMN = "image"
DEFAULT_LABEL_COLUMN = "label"

CODECS = ("gz", "bz2", "zstd")
"""Streaming's shard compressions read here (``zstd`` needs the ``zstandard`` package:
``bnrecal[mds]``); its ``br`` and ``snappy`` are refused."""

_SHARD_NAME = re.compile(r".+\.mds(\.[a-z0-9]+)?")
"""A shard's file name as MDSWriter writes it (``shard.00000.mds``, ``shard.00000.mds.zstd``)."""


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
        if encoding not in INTEGER_ENCODINGS:
            return DatasetOptionError(f"{where}: label column {column!r} is {encoding}, not integer classes "
                                      f"({', '.join(INTEGER_ENCODINGS)})", field="label_column")
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


