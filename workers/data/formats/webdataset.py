"""WebDataset tar shards: the index of a shard's samples, built once and cached, and how a
tar is told apart from an archive of images.

A sample is the consecutive members that share a key (the member path up to the first
``.`` of its file name, as WebDataset splits it): one data member ``KEY.jpg|jpeg|png|webp|bmp``
(an image) or ``KEY.npy`` (an array, fed as it is), and optionally ``KEY.cls``, the
sample's integer class (for evaluation). Other members (``KEY.json``, ``KEY.txt``) are
ignored. A key without a data member, or with two, is refused, naming the shard and the key.

The index holds, per sample, the byte offset and size of its data member and its label: a
rank then reads a member with one ranged read, starting 512 bytes early to check the tar
header in front of it (a shard that changed since it was indexed fails, never feeds other
bytes). It is built by walking the tar's headers (a local uncompressed shard: its headers
only; a gzip shard or an object: one forward pass) and cached under
``<cache root>/shard-index/`` by the shard's location and version (mtime or ETag).
:data:`WEBDATASET` is how the shards' room finds, counts and opens them.
"""

from __future__ import annotations

import os
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from bnrecal.workers.data.formats.columnar import UNLABELLED_INSTEAD
from bnrecal.workers.data.formats.images import is_ignored_part
from bnrecal.workers.data.formats.mds_index import is_mds_shard_name
from bnrecal.workers.data.opened import FoundShards, ShardCandidate, ShardCount, ShardFormat, ShardSource
from bnrecal.workers.data.storage.reads import open_shard, read_ranges
from bnrecal.workers.data.storage.files import TAR_SUFFIXES, ShardRef, is_shard_name
from bnrecal.errors import DatasetError, message_line

DATA_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "npy")
LABEL_EXTENSION = "cls"
NO_LABEL = -1
SNIFF_MEMBERS = 64
_MAX_LABEL_BYTES = 64


@dataclass(frozen=True)
class TarIndex:
    """The samples of one tar shard, in member order: each data member's name, the offset of
    its tar header and of its data, its size, and the sample's label (``NO_LABEL`` without one)."""

    names: tuple[str, ...]
    header: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    label: np.ndarray

    def __len__(self) -> int:
        return len(self.names)

    def save(self, path: Path) -> None:
        """Write the index atomically (a half-written cache is never read)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(staging, "wb") as stream:
            np.savez(
                stream, header=self.header, offset=self.offset, size=self.size, label=self.label,
                names=np.frombuffer("\n".join(self.names).encode("utf-8", "surrogateescape"), dtype=np.uint8),
            )
        os.replace(staging, path)

    @classmethod
    def load(cls, path: Path) -> TarIndex | None:
        """The cached index at ``path``, or None when there is none (or it cannot be read)."""
        try:
            with np.load(path, allow_pickle=False) as saved:
                names = saved["names"].tobytes().decode("utf-8", "surrogateescape").split("\n")
                return cls(tuple(names), saved["header"], saved["offset"], saved["size"], saved["label"])
        except (OSError, ValueError, KeyError):
            return None


def split_key(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member name as WebDataset splits it: the extension is what
    follows the first ``.`` of the file name (lower-cased)."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (ext.lower() if dot else "")


def tar_index(ref: ShardRef, endpoint_url: str | None, cache_root: Path | None, role: str) -> TarIndex:
    """The index of a tar shard: from the cache when this version of it was indexed before,
    else built (and cached)."""
    cached = cache_root / "shard-index" / f"{ref.cache_key}.npz" if cache_root is not None else None
    if cached is not None and (index := TarIndex.load(cached)) is not None:
        return index
    index = build_tar_index(ref, endpoint_url, role)
    if cached is not None:
        try:
            index.save(cached)
        except OSError:
            pass  # a read-only cache only costs a rebuild next time
    return index


def build_tar_index(ref: ShardRef, endpoint_url: str | None, role: str) -> TarIndex:
    """Walk the shard's tar headers once and group its members into samples."""
    names: list[str] = []
    header: list[int] = []
    offset: list[int] = []
    size: list[int] = []
    label: list[int] = []
    keys: dict[str, int] = {}
    current = ""
    member = ""
    stream = open_shard(ref, endpoint_url, role)
    try:
        for info, tar in _members(stream, ref):
            member = info.name
            key, ext = split_key(info.name)
            if not ext or any(is_ignored_part(p) for p in info.name.split("/")):
                continue
            if key != current:
                if current and keys[current] < 0:
                    raise DatasetError(f"shard {ref.name}: sample {current} has no data member ({'|'.join(DATA_EXTENSIONS)})")
                if key in keys:
                    raise DatasetError(
                        f"shard {ref.name}: member {info.name} repeats key {key} of an earlier sample; "
                        "a sample's members must be adjacent"
                    )
                current = key
                keys[key] = -1
                label.append(NO_LABEL)
            if ext in DATA_EXTENSIONS:
                if keys[key] >= 0:
                    raise DatasetError(f"shard {ref.name}: sample {key} has two data members, {names[keys[key]]} and {info.name}")
                keys[key] = len(names)
                names.append(info.name)
                header.append(info.offset_data - tarfile.BLOCKSIZE)
                offset.append(info.offset_data)
                size.append(info.size)
            elif ext == LABEL_EXTENSION:
                label[-1] = _read_label(tar, info, ref)
        if current and keys[current] < 0:
            raise DatasetError(f"shard {ref.name}: sample {current} has no data member ({'|'.join(DATA_EXTENSIONS)})")
    except (tarfile.TarError, zlib.error, EOFError, OSError) as exc:
        where = f" after member {member}" if member else ""
        raise DatasetError(f"shard {ref.name} is truncated or corrupt{where}: {message_line(exc)}") from exc
    finally:
        stream.close()
    if not names:
        raise DatasetError(f"shard {ref.name} holds no samples (members KEY.{'|'.join(DATA_EXTENSIONS)})")
    return TarIndex(
        tuple(names), np.asarray(header, np.int64), np.asarray(offset, np.int64), np.asarray(size, np.int64),
        np.asarray(label, np.int64),
    )


def _members(stream: IO[bytes], ref: ShardRef) -> Iterator[tuple[tarfile.TarInfo, tarfile.TarFile]]:
    """The regular-file members of the shard, in order; a truncated member is an error.

    tarfile stops quietly at a truncated header, and never reads a member's data while
    listing: the end of the last member is checked against the shard's size here."""
    mode = "r|gz" if ref.gzip else "r:"
    with tarfile.open(fileobj=stream, mode=mode) as tar:
        end = 0
        for info in tar:
            if info.isfile():
                if not ref.gzip and info.offset_data + info.size > ref.size:
                    raise EOFError(f"member {info.name} is cut off at the end of the shard")
                yield info, tar
            end = info.offset_data + -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            tar.members.clear()  # keep memory flat on huge shards
        if ref.gzip:  # to the end: a cut-off gzip stream raises here; what follows the last member is zeros
            tail = b""
            while chunk := tar.fileobj.read(1 << 20):  # type: ignore[union-attr]
                tail += chunk.strip(b"\0")
        else:
            stream.seek(end)
            tail = stream.read(ref.size - end)
        if tail.strip(b"\0"):
            raise EOFError("a member header is cut off or corrupt after the last complete member")


def _read_label(tar: tarfile.TarFile, info: tarfile.TarInfo, ref: ShardRef) -> int:
    if info.size > _MAX_LABEL_BYTES:
        raise DatasetError(f"shard {ref.name}: label member {info.name} is {info.size} bytes, not an integer class")
    data = tar.extractfile(info)
    raw = data.read() if data is not None else b""
    try:
        value = int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError) as exc:
        raise DatasetError(f"shard {ref.name}: label member {info.name} holds {raw[:20]!r}, not an integer class") from exc
    if value < 0:
        raise DatasetError(f"shard {ref.name}: label member {info.name} holds {value}; classes are integers >= 0")
    return value


def tar_member_names(path: Path) -> list[str]:
    """The first :data:`SNIFF_MEMBERS` member files of a local tar (plain or compressed), what
    :func:`classify_members` tells it by; a truncated tar gives the members before the cut."""
    files: list[str] = []
    try:
        with tarfile.open(path, "r:*") as tar:
            for info in tar:
                if info.isfile() and not any(is_ignored_part(p) for p in info.name.split("/")):
                    files.append(info.name)
                tar.members.clear()
                if len(files) >= SNIFF_MEMBERS:
                    break
    except (tarfile.TarError, zlib.error, EOFError, OSError):
        pass  # a truncated shard is told by the members before the cut, and fails naming them when indexed
    return files


def head_member_names(head: bytes, gzipped: bool) -> list[str]:
    """The member files in the first bytes of a tar (an object's first range: what is there)."""
    if gzipped:
        try:
            head = zlib.decompressobj(wbits=31).decompress(head, 1 << 20)
        except zlib.error:
            return []
    names = []
    position = 0
    while position + 512 <= len(head) and len(names) < SNIFF_MEMBERS:
        block = head[position : position + 512]
        if not block.strip(b"\0"):
            break
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.TarError:
            break
        if info.isfile():
            names.append(info.name)
        position += 512 + -(-info.size // 512) * 512
    return names


def classify_members(files: list[str]) -> str:
    """What a tar holds, from its first members' names: ``shards`` (every file a ``.tar`` or
    ``.parquet`` shard: an uploaded tar of shards), ``mds`` (MDS shards: an uploaded
    MosaicML Streaming folder), ``webdataset`` (members grouped by key: a ``KEY.cls`` label, a
    ``KEY.npy`` array, or an image beside a non-image member of its key, such as ``KEY.json``)
    or ``images`` (an archive of images, unpacked as before)."""
    if files and all(is_shard_name(name) for name in files):
        return "shards"
    if any(is_mds_shard_name(name) for name in files):
        return "mds"
    seen: dict[str, set[str]] = {}
    for name in files:
        key, ext = split_key(name)
        if ext in (LABEL_EXTENSION, "npy"):
            return "webdataset"
        seen.setdefault(key, set()).add(ext)
    data = set(DATA_EXTENSIONS)
    if any(exts & data and exts - data - {""} for exts in seen.values()):  # an image beside its KEY.json
        return "webdataset"
    return "images"


def inner_shards(path: Path, shown: str) -> list[ShardRef]:
    """The shards inside an (uncompressed) tar of shards, as byte ranges of it, in sorted
    member order: read in place, never unpacked."""
    refs = []
    stat = path.stat()
    with open(path, "rb") as stream:
        if stream.read(6).startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ")):
            raise DatasetError(
                f"{shown} is a compressed tar of shards, which cannot be read in place; pack the shards in a plain "
                ".tar (the shards themselves may be .tar.gz)"
            )
    try:
        with tarfile.open(path, "r:") as tar:
            for info in tar:
                if info.isfile() and not any(is_ignored_part(p) for p in info.name.split("/")):
                    if not is_shard_name(info.name):
                        raise DatasetError(f"{shown}: member {info.name} is not a shard (.tar, .tar.gz, .parquet)")
                    refs.append(ShardRef(
                        str(path), info.size, f"{stat.st_size}-{stat.st_mtime_ns}", f"{shown}:{info.name}", info.offset_data,
                    ))
                tar.members.clear()
    except (tarfile.TarError, zlib.error, EOFError) as exc:
        raise DatasetError(f"{shown} is not a valid tar of shards: {message_line(exc)}") from exc
    return sorted(refs, key=lambda r: r.name)


class TarReader:
    """Reads samples of one tar shard by its index: ranged reads of the members (each with
    its tar header, checked), or for a gzip shard one forward pass per call over the
    decompressed stream, from the start only when a member lies behind the last one read."""

    def __init__(self, ref: ShardRef, index: TarIndex, endpoint_url: str | None) -> None:
        self.ref = ref
        self.index = index
        self.endpoint_url = endpoint_url
        self._stream: IO[bytes] | None = None
        self._tar_stream: IO[bytes] | None = None
        self._position = 0

    def read(self, rows: list[int]) -> list[tuple[str, bytes]]:
        """``(member name, bytes)`` of each sample at ``rows`` (in ascending order)."""
        if self.ref.gzip:
            return [(self.index.names[row], self._read_forward(row)) for row in rows]
        ranges = [(int(self.index.header[r]), int(self.index.offset[r] + self.index.size[r])) for r in rows]
        out = []
        for row, raw in zip(rows, read_ranges(self.ref, ranges, self.endpoint_url)):
            self._check_header(row, raw[: tarfile.BLOCKSIZE])
            out.append((self.index.names[row], raw[tarfile.BLOCKSIZE:]))
        return out

    def _check_header(self, row: int, raw: bytes) -> None:
        name = self.index.names[row]
        try:
            info = tarfile.TarInfo.frombuf(raw, "utf-8", "surrogateescape")
        except tarfile.TarError as exc:
            raise DatasetError(
                f"shard {self.ref.name} changed since it was indexed or is corrupt: no tar header before member {name}"
            ) from exc
        if info.size != int(self.index.size[row]):
            raise DatasetError(f"shard {self.ref.name} changed since it was indexed: member {name} has another size")

    def _read_forward(self, row: int) -> bytes:
        start, size = int(self.index.offset[row]), int(self.index.size[row])
        name = self.index.names[row]
        try:
            if self._tar_stream is None or start < self._position:
                self.close()
                import gzip

                self._stream = open_shard(self.ref, self.endpoint_url)
                self._tar_stream = gzip.GzipFile(fileobj=self._stream, mode="rb")  # type: ignore[assignment]
                self._position = 0
            stream = self._tar_stream
            assert stream is not None
            while self._position < start:
                skipped = len(stream.read(min(start - self._position, 1 << 20)))
                if not skipped:
                    raise EOFError("end of stream")
                self._position += skipped
            data = stream.read(size)
        except (OSError, EOFError, zlib.error) as exc:
            self.close()
            raise DatasetError(f"shard {self.ref.name} is truncated or corrupt at member {name}: {message_line(exc)}") from exc
        self._position += len(data)
        if len(data) != size:
            self.close()
            raise DatasetError(f"shard {self.ref.name} is truncated at member {name}")
        return data

    def encoded_bytes(self, rows: np.ndarray) -> int:
        """The bytes of these rows' data members, as the index says."""
        return int(self.index.size[rows].sum())

    def labels(self) -> np.ndarray:
        """Each sample's class (``NO_LABEL`` where it has no ``.cls``)."""
        return self.index.label

    def unlabelled(self, role: str) -> DatasetError | None:
        """Why evaluation cannot read this shard's labels (the ``KEY.cls`` member the first
        unlabelled sample lacks), or None when every sample has one."""
        missing = np.flatnonzero(self.index.label == NO_LABEL)
        if not missing.size:
            return None
        member = f"{split_key(self.index.names[int(missing[0])])[0]}.{LABEL_EXTENSION}"
        return DatasetError(
            f"{role}: shard {self.ref.name} has no labels: no {member}; give each sample a KEY.{LABEL_EXTENSION} "
            f"member holding its class ({UNLABELLED_INSTEAD})"
        )

    def close(self) -> None:
        """Close the forward stream of a gzip shard (the next read reopens it)."""
        for stream in (self._tar_stream, self._stream):
            if stream is not None:
                stream.close()
        self._tar_stream = self._stream = None
        self._position = 0


def _count(source: ShardSource) -> ShardCount:
    """A tar shard's samples, by its index (built, or from the cache)."""
    return ShardCount(len(tar_index(source.ref, source.endpoint_url, source.cache_root, source.role)))


def _open(source: ShardSource) -> TarReader:
    """A rank's reader of a tar shard (its index from the cache, or built)."""
    return TarReader(source.ref, tar_index(source.ref, source.endpoint_url, source.cache_root, source.role),
                     source.endpoint_url)


def _find(candidate: ShardCandidate) -> FoundShards | None:
    """A tar whose first members are grouped by key (:func:`classify_members`) is one shard; a
    blob's name gets the extension its bytes say (``.tar``, ``.tar.gz``)."""
    if candidate.is_folder or classify_members(candidate.tar_members()) != "webdataset":
        return None
    head = candidate.read(limit=6)
    if head[:3] in (b"BZh", b"\xfd7z"):
        raise DatasetError(f"shard {candidate.shown}: only plain and gzip tars are read as shards (not bzip2 or xz)")
    name = candidate.shard_name
    if not name.lower().endswith(TAR_SUFFIXES):
        name += ".tar.gz" if head[:2] == b"\x1f\x8b" else ".tar"
    return FoundShards("webdataset", [candidate.itself(name)])


WEBDATASET = ShardFormat("webdataset", "tar shards", columns=False, random_access=True, count=_count, open=_open,
                         find=_find, suffixes=TAR_SUFFIXES)
"""WebDataset tars: samples are members grouped by key, no columns; a local plain tar's members
are read by range in any order."""
