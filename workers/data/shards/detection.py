"""Tell whether a data source is a dataset of shards, and describe it (on the driver).

How a source is told apart (docs/data.md, "Shards"):

- a list of paths or URIs, a brace pattern, a manifest (``.manifest``/``.lst``/``.txt``), a
  ``.parquet`` file (or a file starting with Parquet's magic bytes ``PAR1``: an upload), a
  ``save_to_disk`` folder: always shards;
- a folder (or an ``s3://`` prefix) holding shard files and no images or arrays: shards;
- a folder (or an ``s3://`` prefix) with MosaicML Streaming's ``index.json``, or that file
  itself: the MDS shards it lists, in its order (``workers.data.formats.mds_index``);
- a tar (``.tar``, ``.tar.gz``, an uploaded blob) is a WebDataset shard when its first 64
  members are grouped by key (a ``KEY.cls`` label, a ``KEY.npy`` array, or an image beside
  a non-image member of its key such as ``KEY.json``), and a tar of shards when every file in it
  is a ``.tar``/``.tar.gz``/``.parquet`` (read in place, never unpacked); any other tar is an
  archive of images and unpacked as before (docs/data.md, "Images: an archive"), so a plain archive of
  ``NAME.jpg`` files and class folders keeps its meaning.
"""

from __future__ import annotations

import gzip
import os
import tarfile
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bnrecal.errors import DatasetOptionError
from bnrecal.workers.data.formats.archive import TAR
from bnrecal.workers.data.formats.columnar import (
    PARQUET, is_save_to_disk, is_save_to_disk_listing, save_to_disk_files, save_to_disk_names,
)
from bnrecal.workers.data.storage.objectstore import RemoteSource, is_data_uri, remote_error
from bnrecal.workers.data.storage.files import TAR_SUFFIXES, ShardRef, local_ref
from bnrecal.workers.data.shards.listing import (
    LIST_THREADS, MAX_MANIFEST_BYTES, StoredObject, has_brace_pattern, is_manifest_name, list_prefix,
    prefix_shards, read_manifest, refs_of, shard_files_in,
)
from bnrecal.workers.data.shards.dataset import ShardData, ShardSet, decode_sample
from bnrecal.workers.data.shards.shard_formats import columned, shard_format
from bnrecal.workers.data.opened import ShardCount, ShardSource
from bnrecal.workers.data.formats.transform import ImageTransform, resolve_transform
from bnrecal.workers.data.formats.webdataset import classify_members, inner_shards, tar_kind
from bnrecal.workers.data.formats.npy_layout import NPY_MAGIC
from bnrecal.workers.data.formats.mds_index import MDS_INDEX, MdsIndex, is_mds_index, mds_in_tar, read_index_bytes, read_mds_index
from bnrecal.errors import DatasetError

_SNIFF_BYTES = 1 << 16


@dataclass(frozen=True)
class FoundShards:
    """A source told to be a dataset of shards: its format, its shards in order, and for MDS
    the index that listed them (read once, here, and described from)."""

    format: str
    refs: list[ShardRef]
    listing: MdsIndex | None = None


def local_shards(
    source: Path, shown: str, role: str, endpoint_url: str | None, cache_root: Path | None = None,
) -> FoundShards | None:
    """``(format, shards)`` when a local path (existing or a brace pattern) is a dataset of
    shards, else None (arrays, image folders and image archives go their old ways)."""
    text = str(source)
    if not source.exists() and has_brace_pattern(text):
        return _format_of(refs_of([text], role, endpoint_url, cache_root))
    if source.is_dir():
        if is_save_to_disk(source):
            return FoundShards("arrow", save_to_disk_files(source, shown, role))
        if (source / MDS_INDEX).is_file():
            found = _mds_shards(str(source / MDS_INDEX), f"{shown}/{MDS_INDEX}", role, endpoint_url, cache_root)
            if found is not None:
                return found
        files = shard_files_in(source)
        return None if files is None else _format_of([local_ref(source / f, f) for f in files])
    if not source.is_file():
        return None
    lower = source.name.lower()
    if lower == MDS_INDEX:
        found = _mds_shards(str(source), shown, role, endpoint_url, cache_root)
        if found is not None:
            return found
    if is_manifest_name(lower):
        if source.stat().st_size > MAX_MANIFEST_BYTES:
            raise DatasetError(f"manifest {shown} is larger than {MAX_MANIFEST_BYTES} bytes")
        text = source.read_text(errors="replace")
        return _format_of(refs_of(read_manifest(text, str(source.parent), shown, role), role, endpoint_url, cache_root))
    with open(source, "rb") as stream:
        head = stream.read(4)
    if PARQUET.names(lower) or PARQUET.sniffs(head, source):
        return FoundShards("parquet", [local_ref(source, shown if shown.lower().endswith(".parquet") else f"{shown}.parquet")])
    if not TAR.names(lower) and not _sniffs_tar(source):
        return None
    kind = tar_kind(source)
    if kind == "shards":
        return _format_of(inner_shards(source, shown))
    if kind == "mds":
        listed, refs = mds_in_tar(source, shown)
        return _mds_found(listed, refs)
    if kind == "webdataset":
        if head[:3] in (b"BZh", b"\xfd7z"):
            raise DatasetError(f"shard {shown}: only plain and gzip tars are read as shards (not bzip2 or xz)")
        name = shown if shown.lower().endswith(TAR_SUFFIXES) else shown + (".tar.gz" if head[:2] == b"\x1f\x8b" else ".tar")
        return FoundShards("webdataset", [local_ref(source, name)])
    return None


def remote_shards(remote: RemoteSource, kind: str, role: str, cache_root: Path | None) -> FoundShards | None:
    """:func:`local_shards` for an ``s3://`` object or prefix (``kind`` from ``stat_object``)."""
    if has_brace_pattern(remote.uri):
        return _format_of(refs_of([remote.uri], role, remote.endpoint_url, cache_root))
    if kind == "directory":
        objects = list_prefix(remote, role, cache_root)
        if is_save_to_disk_listing([name for name in objects if "/" not in name]):
            return FoundShards("arrow", _remote_save_to_disk(remote, objects, role))
        if MDS_INDEX in objects:
            found = _mds_shards(f"{remote.uri.rstrip('/')}/{MDS_INDEX}", f"{remote.uri.rstrip('/')}/{MDS_INDEX}", role,
                                remote.endpoint_url, cache_root)
            if found is not None:
                return found
        refs = prefix_shards(remote, objects)
        return None if refs is None else _format_of(refs)
    lower = remote.name.lower()
    if lower == MDS_INDEX:
        found = _mds_shards(remote.uri, remote.uri, role, remote.endpoint_url, cache_root)
        if found is not None:
            return found
    fs = remote.filesystem()
    if is_manifest_name(lower):
        try:
            raw = fs.cat_file(remote.key, start=0, end=MAX_MANIFEST_BYTES + 1)
        except Exception as exc:  # noqa: BLE001 - storage errors come in many types, all reported one way
            raise remote_error(exc, remote, role) from exc
        if len(raw) > MAX_MANIFEST_BYTES:
            raise DatasetError(f"manifest {remote.uri} is larger than {MAX_MANIFEST_BYTES} bytes")
        base = remote.uri.rsplit("/", 1)[0]
        entries = read_manifest(raw.decode(errors="replace"), base, remote.name, role)
        return _format_of(refs_of(entries, role, remote.endpoint_url, cache_root))
    if lower.endswith(".parquet"):
        return _format_of(refs_of([remote.uri], role, remote.endpoint_url))
    if not lower.endswith(TAR_SUFFIXES):
        return None
    try:
        head = fs.cat_file(remote.key, start=0, end=_SNIFF_BYTES)
    except Exception as exc:  # noqa: BLE001
        raise remote_error(exc, remote, role) from exc
    if classify_members(_member_names(head, lower.endswith((".tar.gz", ".tgz")))) != "webdataset":
        return None
    return _format_of(refs_of([remote.uri], role, remote.endpoint_url))


def _mds_shards(
    index: str, shown: str, role: str, endpoint_url: str | None, cache_root: Path | None,
) -> FoundShards | None:
    """The MDS shards a Streaming ``index.json`` (a local path or URI) lists, beside it, in
    its order; None when the file is another ``index.json``."""
    raw = read_index_bytes(index, endpoint_url, f"{role}: {shown}")
    if not is_mds_index(raw):
        return None
    listed = read_mds_index(raw, f"{role}: {shown}")
    base = index.rsplit("/", 1)[0]
    locations = [f"{base}/{name}" for name in listed.basenames]
    if is_data_uri(index):
        return _mds_found(listed, refs_of(locations, role, endpoint_url, cache_root))
    missing = [name for name, location in zip(listed.basenames, locations) if not Path(location).is_file()]
    if missing:
        raise DatasetError(f"{role}: {shown} lists shard {missing[0]}, which is not below it")
    return _mds_found(listed, [local_ref(Path(location), name) for name, location in zip(listed.basenames, locations)])


def _mds_found(listed: MdsIndex, refs: list[ShardRef]) -> FoundShards:
    """MDS shards as their index lists them, each file the size the index says (a shard
    changed or cut since is refused here, before any work)."""
    listed.check_sizes([ref.size for ref in refs], [ref.name for ref in refs])
    return FoundShards("mds", refs, listed)


def _remote_save_to_disk(remote: RemoteSource, objects: dict[str, StoredObject], role: str) -> list[ShardRef]:
    """The Arrow files of a ``save_to_disk`` folder under an ``s3://`` prefix (its listing
    ``objects``), in ``state.json``'s order, read as the same folder on disk is."""
    fs = remote.filesystem()
    base = remote.uri.rstrip("/")

    def read(name: str) -> bytes:
        try:
            return bytes(fs.cat_file(f"{remote.key}/{name}"))
        except Exception as exc:  # noqa: BLE001 - storage errors come in many types, all reported one way
            raise remote_error(exc, RemoteSource(f"{base}/{name}", remote.endpoint_url), role) from exc

    top = [name for name in objects if "/" not in name]
    return [objects[name].shard(base, name) for name in save_to_disk_names(top, read, remote.uri, role)]


def list_shards(
    entries: Sequence[str | os.PathLike[str]], role: str, endpoint_url: str | None, cache_root: Path | None = None,
) -> FoundShards:
    """``(format, shards)`` of an explicit list of shard paths, URIs or brace patterns."""
    return _format_of(refs_of(list(entries), role, endpoint_url, cache_root))


def _member_names(head: bytes, gzipped: bool) -> list[str]:
    """The member names in the first bytes of a tar (a partial read: what is there)."""
    if gzipped:
        try:
            head = zlib.decompressobj(wbits=31).decompress(head, 1 << 20)
        except zlib.error:
            return []
    names = []
    position = 0
    while position + 512 <= len(head) and len(names) < 64:
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


def _sniffs_tar(path: Path) -> bool:
    with open(path, "rb") as stream:
        head = stream.read(512)
    if head[:2] == b"\x1f\x8b":
        try:
            with gzip.open(path) as unpacked:
                head = unpacked.read(512)
        except (OSError, EOFError):
            return False
    return head[257:262] == b"ustar"


def _format_of(refs: list[ShardRef]) -> FoundShards:
    suffixes = {".parquet" if ref.suffix == ".parquet" else ".tar" for ref in refs}
    if len(suffixes) > 1:
        raise DatasetError("the shards mix tar and Parquet files; give one format")
    return FoundShards("parquet" if suffixes == {".parquet"} else "webdataset", refs)


def describe_shards(
    found: FoundShards,
    *,
    transform: Mapping[str, Any] | None,
    image_column: str | None,
    label_column: str | None,
    endpoint_url: str | None,
    cache_root: Path | None,
    role: str,
    strict_columns: bool = True,
) -> tuple[ShardSet, ImageTransform | None, tuple[int, ...]]:
    """Count every shard's samples (building or loading each tar's index, reading each
    Parquet footer), concurrently, and read the first sample for the sample shape:
    ``(shards, transform or None for arrays, sample shape)``; tar shards refuse column names,
    or without ``strict_columns`` read as if none were given."""
    kind, refs = shard_format(found.format), found.refs
    if not kind.columns and not strict_columns:
        image_column = label_column = None
    if not kind.columns and (image_column is not None or label_column is not None):
        raise DatasetOptionError(f"image_column and label_column apply to {columned('and')} data, not {kind.shown}",
                                 field="image_column")
    resolved = resolve_transform(transform)  # bad options fail before any read
    cache = str(cache_root) if cache_root else None

    def count(position: int) -> ShardCount:
        return kind.count(ShardSource(refs[position], position, role, image_column=image_column,
                                      label_column=label_column, listing=found.listing, endpoint_url=endpoint_url,
                                      cache_root=cache_root))

    with ThreadPoolExecutor(max(1, min(LIST_THREADS, len(refs)))) as pool:
        counted = list(pool.map(count, range(len(refs))))
    columns = {c.image_column for c in counted if c.image_column is not None}
    if len(columns) > 1:
        raise DatasetOptionError(
            f"the shards' image columns differ ({', '.join(sorted(columns))}); set image_column to the one to read",
            field="image_column",
        )
    empty = [ref.name for ref, c in zip(refs, counted) if c.rows == 0]
    if empty and len(empty) == len(refs):
        raise DatasetError(f"{role}: the shards hold no samples ({empty[0]} is empty)")
    shards = ShardSet(
        format=kind.name, shards=tuple(refs), counts=tuple(c.rows for c in counted),
        groups=tuple(c.groups for c in counted),
        image_column=columns.pop() if columns else None, label_column=label_column, listing=found.listing,
        endpoint_url=endpoint_url, cache_root=cache,
    )
    return _with_first_sample(shards, transform, resolved, refs)


def _with_first_sample(
    shards: ShardSet, transform: Mapping[str, Any] | None, resolved: ImageTransform, refs: list[ShardRef],
) -> tuple[ShardSet, ImageTransform | None, tuple[int, ...]]:
    """The described shards with their transform (None for arrays) and sample shape, from
    the first sample, read and decoded: a dataset whose first sample is broken fails here."""
    first = ShardData(shards, np.zeros(1, np.int64), resolved, (), False)
    try:
        (name, data), = first.load_encoded(0, 1)
    finally:
        first.close()
    if data.startswith(NPY_MAGIC):
        if transform:
            raise DatasetOptionError(f"transform applies to image data only; the samples of {refs[0].name} are arrays",
                                     field="transform")
        return shards, None, tuple(decode_sample(name, data, None).shape)
    decode_sample(name, data, resolved)  # the first image decodes, or the data fails here, naming it
    return shards, resolved, resolved.sample_shape


def is_shard_list(value: Any) -> bool:
    """Whether ``value`` is a list or tuple of paths or URIs (shards given one by one)."""
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(v, (str, os.PathLike)) or is_data_uri(v) for v in value
    )
