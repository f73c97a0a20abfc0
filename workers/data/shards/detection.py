"""Tell whether a data source is a dataset of shards, and describe it (on the driver).

How a source is told apart (docs/data.md, "Shards"): what names shards whatever their format
is this module's: a list of paths or URIs, a brace pattern, a manifest
(``.manifest``/``.lst``/``.txt``), a folder (or an ``s3://`` prefix) holding shard files and no
images or arrays, a plain tar of shards (every file in it a ``.tar``/``.tar.gz``/``.parquet``,
read in place, never unpacked), each shard's format named by its extension (the formats'
``suffixes``). Any other file or folder is shown, as a :class:`ShardCandidate` that reads a
disk and S3 alike, to each format of shards in ``SHARD_FORMATS`` order, whose ``find`` says
whether it is its own: a WebDataset tar (its first 64 members grouped by key), a Parquet file,
a ``save_to_disk`` folder, MosaicML Streaming's ``index.json`` or its folder. What none takes
(an image folder, arrays, an archive of images) goes its old way.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from bnrecal.errors import DatasetError, DatasetOptionError
from bnrecal.workers.data.formats.archive import TAR
from bnrecal.workers.data.formats.npy_layout import NPY_MAGIC
from bnrecal.workers.data.formats.transform import ImageTransform, resolve_transform
from bnrecal.workers.data.formats.webdataset import head_member_names, inner_shards, tar_member_names
from bnrecal.workers.data.opened import FoundShards, ShardCount, ShardSource
from bnrecal.workers.data.shards.dataset import ShardData, ShardSet, decode_sample
from bnrecal.workers.data.shards.listing import (
    LIST_THREADS, MAX_MANIFEST_BYTES, StoredObject, has_brace_pattern, is_manifest_name, list_prefix,
    prefix_shards, read_manifest, refs_of, remote_refs, shard_files_in,
)
from bnrecal.workers.data.shards.shard_formats import SHARD_FORMATS, columned, shard_format
from bnrecal.workers.data.storage.files import TAR_SUFFIXES, ShardRef, is_shard_name, local_ref
from bnrecal.workers.data.storage.objectstore import RemoteSource, is_data_uri, remote_error

_SNIFF_BYTES = 1 << 16


def local_shards(
    source: Path, shown: str, role: str, endpoint_url: str | None, cache_root: Path | None = None,
) -> FoundShards | None:
    """The shards a local path (existing, or a brace pattern) is, else None (arrays, image
    folders and image archives go their old ways); ``shown`` is what messages call it."""
    if not source.exists() and has_brace_pattern(str(source)):
        return _format_of(refs_of([str(source)], role, endpoint_url, cache_root))
    if not source.is_dir() and not source.is_file():
        return None
    return _find(LocalCandidate(source, shown, role, endpoint_url, cache_root))


def remote_shards(remote: RemoteSource, kind: str, role: str, cache_root: Path | None) -> FoundShards | None:
    """:func:`local_shards` for an ``s3://`` object or prefix (``kind`` from ``stat_object``)."""
    if has_brace_pattern(remote.uri):
        return _format_of(refs_of([remote.uri], role, remote.endpoint_url, cache_root))
    return _find(RemoteCandidate(remote, kind == "directory", role, cache_root))


def list_shards(
    entries: Sequence[str | os.PathLike[str]], role: str, endpoint_url: str | None, cache_root: Path | None = None,
) -> FoundShards:
    """The shards of an explicit list of shard paths, URIs or brace patterns."""
    return _format_of(refs_of(list(entries), role, endpoint_url, cache_root))


def _find(candidate: LocalCandidate | RemoteCandidate) -> FoundShards | None:
    """What names shards whatever their format (a manifest, a tar of shards, a folder of
    shard files), else the first format of shards whose ``find`` takes the candidate."""
    if not candidate.is_folder:
        if is_manifest_name(candidate.file_name.lower()):
            return _format_of(candidate.manifest_refs())
        members = candidate.tar_members()
        if candidate.local is not None and members and all(is_shard_name(name) for name in members):
            return _format_of(inner_shards(candidate.local, candidate.shown))
    for each in SHARD_FORMATS:
        found = each.find(candidate)
        if found is not None:
            return found
    if not candidate.is_folder:
        return None
    refs = candidate.shard_files()
    return None if refs is None else _format_of(refs)


def _format_of(refs: list[ShardRef]) -> FoundShards:
    """Shards named one by one: their format, the one whose extensions name them all."""
    named = {ref.name: next((f.name for f in SHARD_FORMATS if f.suffixes and ref.name.lower().endswith(f.suffixes)), None)
             for ref in refs}
    unnamed = next((name for name, format_name in named.items() if format_name is None), None)
    if unnamed is not None:
        raise DatasetError(f"{unnamed} is not a .tar, .tar.gz/.tgz or .parquet shard")
    formats = set(named.values())
    if len(formats) > 1:
        raise DatasetError("the shards mix tar and Parquet files; give one format")
    return FoundShards(formats.pop(), refs)


class LocalCandidate:
    """A local file or folder as the formats of shards see it (:class:`ShardCandidate`)."""

    def __init__(self, path: Path, shown: str, role: str, endpoint_url: str | None, cache_root: Path | None) -> None:
        self.local: Path | None = path
        self._path = path
        self.role, self.shown, self.shard_name, self.file_name = role, shown, shown, path.name
        self.is_folder = path.is_dir()
        self._endpoint_url, self._cache_root = endpoint_url, cache_root

    def has(self, name: str) -> bool:
        return (self._path / name).is_file()

    def names(self) -> Collection[str]:
        return {entry.name for entry in self._path.iterdir() if entry.is_file()}

    def read(self, name: str | None = None, limit: int | None = None) -> bytes:
        path = self._path / name if name is not None else self._path
        try:
            with open(path, "rb") as stream:
                return stream.read(-1 if limit is None else limit)
        except OSError as exc:
            shown = f"{self.shown}/{name}" if name is not None else self.shown
            raise DatasetError(f"cannot read {self.role}: {shown}: {exc.strerror or exc}") from exc

    def refs(self, names: Sequence[str], where: str) -> list[ShardRef]:
        base = self._path if self.is_folder else self._path.parent
        missing = [name for name in names if not (base / name).is_file()]
        if missing:
            raise DatasetError(f"{where} lists shard {missing[0]}, which is not below it")
        return [local_ref(base / name, name) for name in names]

    def itself(self, name: str) -> ShardRef:
        return local_ref(self._path, name)

    def tar_members(self) -> list[str]:
        return self._tar_members

    @cached_property
    def _tar_members(self) -> list[str]:
        if self.is_folder or not (TAR.names(self.file_name) or _sniffs_tar(self._path)):
            return []
        return tar_member_names(self._path)

    def manifest_refs(self) -> list[ShardRef]:
        """The shards a manifest file lists, relative paths beside it."""
        if self._path.stat().st_size > MAX_MANIFEST_BYTES:
            raise DatasetError(f"manifest {self.shown} is larger than {MAX_MANIFEST_BYTES} bytes")
        entries = read_manifest(self._path.read_text(errors="replace"), str(self._path.parent), self.shown, self.role)
        return refs_of(entries, self.role, self._endpoint_url, self._cache_root)

    def shard_files(self) -> list[ShardRef] | None:
        """The folder's shard files when it holds shards and no other data, else None."""
        files = shard_files_in(self._path)
        return None if files is None else [local_ref(self._path / name, name) for name in files]


class RemoteCandidate:
    """An ``s3://`` object or prefix as the formats of shards see it (:class:`ShardCandidate`):
    a prefix listed once (cached), an object's first 64 KiB fetched once."""

    def __init__(self, remote: RemoteSource, is_folder: bool, role: str, cache_root: Path | None) -> None:
        self.local: Path | None = None
        self._remote = remote
        self.role, self.shown, self.shard_name, self.file_name = role, remote.uri, remote.name, remote.name
        self.is_folder = is_folder
        self._cache_root = cache_root

    @cached_property
    def _folder(self) -> RemoteSource:
        """The prefix listed: this one, or the one an object lies in."""
        return self._remote if self.is_folder else RemoteSource(self._remote.uri.rsplit("/", 1)[0], self._remote.endpoint_url)

    @cached_property
    def _objects(self) -> dict[str, StoredObject]:
        return list_prefix(self._folder, self.role, self._cache_root)

    def has(self, name: str) -> bool:
        return name in self._objects

    def names(self) -> Collection[str]:
        return [name for name in self._objects if "/" not in name]

    def read(self, name: str | None = None, limit: int | None = None) -> bytes:
        if name is None and limit is not None and limit <= _SNIFF_BYTES:
            return self._head[:limit]
        return self._fetch(name, limit)

    @cached_property
    def _head(self) -> bytes:
        return self._fetch(None, _SNIFF_BYTES)

    def _fetch(self, name: str | None, limit: int | None) -> bytes:
        source = self._remote if name is None else RemoteSource(f"{self._remote.uri.rstrip('/')}/{name}",
                                                                 self._remote.endpoint_url)
        try:
            return bytes(source.filesystem().cat_file(source.key, start=0 if limit is not None else None, end=limit))
        except Exception as exc:  # noqa: BLE001 - storage errors come in many types, all reported one way
            raise remote_error(exc, source, self.role) from exc

    def refs(self, names: Sequence[str], where: str) -> list[ShardRef]:
        # As any list of objects (remote_refs): a HEAD each, or for many the prefix listed afresh
        # where the kept listing lacks one, so shards written since a listing are seen as they are.
        base = self._folder.uri.rstrip("/")
        return remote_refs([f"{base}/{name}" for name in names], self.role, self._remote.endpoint_url, self._cache_root)

    def itself(self, name: str) -> ShardRef:
        return replace(remote_refs([self._remote.uri], self.role, self._remote.endpoint_url)[0], name=name)

    def tar_members(self) -> list[str]:
        lower = self.file_name.lower()
        if self.is_folder or not lower.endswith(TAR_SUFFIXES):
            return []
        return head_member_names(self._head, lower.endswith((".tar.gz", ".tgz")))

    def manifest_refs(self) -> list[ShardRef]:
        """The shards a manifest object lists, relative keys beside it."""
        raw = self._fetch(None, MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise DatasetError(f"manifest {self.shown} is larger than {MAX_MANIFEST_BYTES} bytes")
        entries = read_manifest(raw.decode(errors="replace"), self._folder.uri, self._remote.name, self.role)
        return refs_of(entries, self.role, self._remote.endpoint_url, self._cache_root)

    def shard_files(self) -> list[ShardRef] | None:
        """The prefix's shard objects when it holds shards and no other data, else None."""
        return prefix_shards(self._remote, self._objects)


def _sniffs_tar(path: Path) -> bool:
    """Whether a local file (an uploaded blob, without an extension) starts as a tar does,
    plain or gzip."""
    with open(path, "rb") as stream:
        head = stream.read(512)
    if head[:2] == b"\x1f\x8b":
        try:
            with gzip.open(path) as unpacked:
                head = unpacked.read(512)
        except (OSError, EOFError):
            return False
    return head[257:262] == b"ustar"


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
