"""Which shards a dataset is made of: brace patterns, folders, manifests, lists and S3 prefixes.

A dataset of shards is a sorted list of :class:`ShardRef`: where each shard lies (a local
path or an ``s3://`` URI, or a byte range of a file: a shard inside an uploaded tar of
shards), its size, and its version (a local file's size and mtime, an object's ETag), which
keys the cache of its index (:func:`workers.data.formats.webdataset.tar_index`). The listing happens once, on
the driver; the ranks get the list with the dataset's description and never list again.
Rules (docs/data.md):

- a brace pattern ``train-{000000..000146}.tar`` expands numeric ranges (zero-padded as
  written) and comma lists ``{a,b}``, in the last path component only, and keeps the
  expansion's order sorted, like every other listing;
- a folder holding no image and only shard files (``.tar``, ``.tar.gz``/``.tgz``,
  ``.parquet``), at any depth, is the shards in sorted relative path order; a Hugging Face
  layout with several splits (``data/train-*.parquet`` beside ``data/test-*.parquet``) is
  refused, naming them;
- a manifest (``.manifest``, ``.lst``, ``.txt``) holds one path or URI a line (relative
  paths are relative to the manifest; blank lines and ``#`` comments are skipped), taken
  in its own order;
- an ``s3://`` prefix is listed once, paginated, in concurrent key ranges, and the
  listing is cached on local disk for :data:`LISTING_TTL_S`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bnrecal.workers.data.opened import FileFormat
from bnrecal.workers.data.storage.files import ShardRef, is_shard_name, local_ref
from bnrecal.workers.data.storage.objectstore import RemoteSource, is_data_uri, parse_data_uri, remote_error
from bnrecal.errors import DatasetError

MANIFEST_SUFFIXES = (".manifest", ".lst", ".txt")
MANIFEST = FileFormat("manifest", MANIFEST_SUFFIXES, "shards")
"""A manifest, one shard path or URI a line: named by its extension only (a blob never reads as one)."""
MAX_PATTERN_SHARDS = 10_000_000
MAX_MANIFEST_BYTES = 256 * 2**20
LISTING_TTL_S = 900.0
"""How long a cached ``s3://`` prefix listing is reused: a second job on the same prefix
within this time makes no list request (``BNRECAL_LISTING_TTL_S`` overrides it)."""
LIST_THREADS = 16
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_SPLITS = re.compile(r"^(train|test|validation|valid|val|dev)([-_.]|$)")


def is_manifest_name(name: str) -> bool:
    """Whether a file name is a manifest's (``.manifest``, ``.lst``, ``.txt``)."""
    return MANIFEST.names(name)


def has_brace_pattern(value: str) -> bool:
    """Whether a path or URI is written as a brace pattern (``{000..146}``, ``{a,b}``)."""
    return bool(_BRACE.search(value))


def expand_braces(pattern: str) -> list[str]:
    """Every name a brace pattern stands for, sorted (numbers zero-padded as written).

    Braces may only stand in the last path component and may only expand to plain names
    (letters, digits, ``_ . -``), so a pattern never reaches another folder than it names.
    """
    head, _, last = pattern.rpartition("/")
    if has_brace_pattern(head):
        raise DatasetError(f"{pattern}: braces may stand in the last path component only")
    names = [last]
    while True:
        expanded: list[str] = []
        for name in names:
            match = _BRACE.search(name)
            if match is None:
                expanded.append(name)
                continue
            expanded.extend(name[: match.start()] + alt + name[match.end():] for alt in _alternatives(match.group(1), pattern))
            if len(expanded) > MAX_PATTERN_SHARDS:
                raise DatasetError(f"{pattern} expands to more than {MAX_PATTERN_SHARDS} shards")
        if expanded == names:
            break
        names = expanded
    for name in names:
        if not _NAME.match(name) or name in (".", ".."):
            raise DatasetError(f"{pattern}: {name!r} is not a plain file name")
    return sorted({f"{head}/{name}" if head else name for name in names})


def _alternatives(body: str, pattern: str) -> list[str]:
    ranged = _RANGE.match(body)
    if ranged:
        first, last = ranged.group(1), ranged.group(2)
        width = len(first) if first.lstrip("-").startswith("0") else 0
        low, high = int(first), int(last)
        if high < low:
            raise DatasetError(f"{pattern}: range {{{body}}} runs backwards")
        if high - low >= MAX_PATTERN_SHARDS:
            raise DatasetError(f"{pattern} expands to more than {MAX_PATTERN_SHARDS} shards")
        return [str(i).zfill(width) for i in range(low, high + 1)]
    if "," in body:
        return body.split(",")
    raise DatasetError(f"{pattern}: {{{body}}} is neither a range {{000..146}} nor a list {{a,b}}")


def list_local_pattern(pattern: str, role: str) -> list[ShardRef]:
    """The shards of a local brace pattern; a missing one is an error naming it."""
    refs = []
    for item in expand_braces(str(Path(pattern).expanduser().absolute())):
        path = Path(item)
        if not path.is_file():
            raise DatasetError(f"{role}: shard {path.name} of {Path(pattern).name} not found")
        refs.append(local_ref(path, path.name))
    return refs


def shard_files_in(folder: Path) -> list[str] | None:
    """The shard files of a folder (relative POSIX paths, sorted) when it holds shards and no
    other data files; None when it is not a folder of shards (an image folder, say)."""
    from bnrecal.workers.data.formats.images import is_ignored_part, is_image_name

    shards: list[str] = []
    for current, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not is_ignored_part(d))
        relative = Path(current).relative_to(folder).as_posix()
        prefix = "" if relative == "." else relative + "/"
        for name in filenames:
            if is_ignored_part(name):
                continue
            if is_shard_name(name):
                shards.append(prefix + name)
            elif is_image_name(name) or name.lower().endswith((".npy", ".npz", ".zip")):
                return None  # an image folder (or other data): stop at its first file, not after listing it all
    if not shards:
        return None
    check_one_split(shards, folder.name)
    return sorted(shards)


def check_one_split(names: Sequence[str], shown: str) -> None:
    """Refuse a listing that mixes a dataset's splits (``train-*`` beside ``test-*``)."""
    splits = sorted({m.group(1) for n in names if (m := _SPLITS.match(n.rsplit("/", 1)[-1]))})
    if len(splits) > 1:
        raise DatasetError(
            f"{shown} holds the shards of several splits ({', '.join(splits)}); give one split's shards "
            "(a brace pattern, its folder, or a manifest)"
        )


def read_manifest(text: str, base: str, shown: str, role: str = "data") -> list[str]:
    """The paths or URIs of a manifest, relative paths resolved against ``base`` (a folder or
    a ``s3://`` prefix); ``role`` names the data in messages (a ``.txt`` given by mistake
    is read as a manifest, so the message says which input it was)."""
    entries = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not is_shard_name(line):
            raise DatasetError(
                f"{role}: manifest {shown}, line {number}: {line!r} is not a .tar, .tar.gz or .parquet shard"
            )
        if is_data_uri(line):
            entries.append(parse_data_uri(line, f"manifest {shown}, line {number}"))
        elif is_data_uri(base):
            if line.startswith("/"):
                raise DatasetError(f"manifest {shown}, line {number}: a manifest in object storage lists keys, not local paths")
            entries.append(parse_data_uri(f"{base.rstrip('/')}/{line}", f"manifest {shown}, line {number}"))
        else:
            entries.append(str((Path(base) / Path(line).expanduser()).absolute()))
    if not entries:
        raise DatasetError(f"manifest {shown} lists no shards")
    return entries


def refs_of(
    entries: Sequence[str | os.PathLike[str]], role: str, endpoint_url: str | None, cache_root: Path | None = None,
) -> list[ShardRef]:
    """The shards a list names (paths, URIs or brace patterns), in the list's order."""
    refs: list[ShardRef] = []
    remote: list[str] = []
    for entry in entries:
        text = os.fspath(entry)
        if is_data_uri(text):
            remote.extend(expand_braces(text) if has_brace_pattern(text) else [parse_data_uri(text, "data")])
            continue
        if remote:
            refs.extend(remote_refs(remote, role, endpoint_url, cache_root))
            remote = []
        if has_brace_pattern(text):
            refs.extend(list_local_pattern(text, role))
            continue
        path = Path(text).expanduser().absolute()
        if not path.is_file():
            raise DatasetError(f"{role}: shard {text} not found")
        if not is_shard_name(path.name):
            raise DatasetError(f"{role}: {path.name} is not a .tar, .tar.gz/.tgz or .parquet shard")
        refs.append(local_ref(path, path.name))
    if remote:
        refs.extend(remote_refs(remote, role, endpoint_url, cache_root))
    if not refs:
        raise DatasetError(f"{role}: the list of shards is empty")
    return refs


HEAD_LIMIT = 16
"""More shards than this in one folder are found by listing the folder once (1,000 a request),
fewer by a HEAD request each."""


def remote_refs(
    uris: Sequence[str], role: str, endpoint_url: str | None, cache_root: Path | None = None
) -> list[ShardRef]:
    """The shards at these object URIs, in order; a missing one fails naming it. Many in one
    folder (a brace pattern, a manifest): that folder listed once (:func:`list_prefix`,
    cached; listed afresh when a shard is not in the cached listing); a few: a HEAD each,
    concurrently."""
    if not uris:
        return []
    folders: dict[str, list[str]] = {}
    for uri in uris:
        folders.setdefault(uri.rsplit("/", 1)[0], []).append(uri)
    found: dict[str, ShardRef] = {}
    for folder, members in folders.items():
        if len(members) > HEAD_LIMIT:
            found.update(_listed_refs(RemoteSource(folder, endpoint_url), members, role, cache_root))
        else:
            found.update(zip(members, _headed_refs(members, role, endpoint_url)))
    return [found[uri] for uri in uris]


def _listed_refs(folder: RemoteSource, uris: list[str], role: str, cache_root: Path | None) -> dict[str, ShardRef]:
    objects = list_prefix(folder, role, cache_root)
    base = folder.uri.rstrip("/") + "/"
    if any(uri[len(base):] not in objects for uri in uris) and cache_root is not None:
        objects = list_prefix(folder, role, cache_root, fresh=True)
    refs = {}
    for uri in uris:
        name = uri[len(base):]
        if name not in objects:
            raise DatasetError(f"{role}: shard {uri} not found")
        refs[uri] = objects[name].shard(folder.uri, name)
    return refs


def _headed_refs(uris: Sequence[str], role: str, endpoint_url: str | None) -> list[ShardRef]:
    """The shards at these object URIs, a HEAD each, concurrently."""
    fs = RemoteSource(uris[0], endpoint_url).filesystem()

    def head(uri: str) -> ShardRef:
        source = RemoteSource(uri, endpoint_url)
        try:
            info = fs.info(source.key)
        except Exception as exc:  # noqa: BLE001 - storage errors come in many types, all reported one way
            raise remote_error(exc, source, role) from exc
        return _remote_ref(uri, StoredObject.headed(source.key, info), source.name)

    with ThreadPoolExecutor(min(LIST_THREADS, len(uris))) as pool:
        return list(pool.map(head, uris))


def _remote_ref(uri: str, found: StoredObject, name: str) -> ShardRef:
    return ShardRef(uri, found.size, found.version, name)


@dataclass(frozen=True)
class StoredObject:
    """An object as object storage describes it (a ListObjectsV2 entry, fsspec's ``info`` of
    a HEAD request): its key, its size and its version, what a shard's index is keyed by."""

    key: str
    size: int
    version: str

    @classmethod
    def listed(cls, entry: Mapping[str, Any]) -> StoredObject:
        """An entry of a ListObjectsV2 page: ``Key``, ``Size`` and ``ETag`` ("" when absent)."""
        return cls(str(entry["Key"]), int(entry.get("Size") or 0), str(entry.get("ETag", "")).strip('"'))

    @classmethod
    def headed(cls, key: str, info: Mapping[str, Any]) -> StoredObject:
        """fsspec's ``info`` of the object at ``key``: its ETag stands for its version, else
        its modification time, else its size."""
        version = str(info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("size"))
        return cls(key, int(info.get("size") or 0), version.strip('"'))

    def shard(self, base: str, name: str) -> ShardRef:
        """The object ``name`` under ``base`` (a prefix URI) as a shard (its size stands for
        its version where the listing gave no ETag)."""
        return ShardRef(f"{base.rstrip('/')}/{name}", self.size, self.version or str(self.size), name)


def list_prefix(
    source: RemoteSource, role: str, cache_root: Path | None, *, fresh: bool = False
) -> dict[str, StoredObject]:
    """Every object under a prefix (by relative key), listed once, paginated
    and in concurrent key ranges (:func:`list_keys`); cached on disk for :data:`LISTING_TTL_S`
    (``fresh`` lists again and replaces the cached listing)."""
    ttl = float(os.environ.get("BNRECAL_LISTING_TTL_S", LISTING_TTL_S))
    base = source.key + "/"
    within = base.partition("/")[2]  # ListObjectsV2 keys do not start with the bucket
    cache = None
    if cache_root is not None:
        digest = hashlib.sha256(f"{source.uri}\0{source.endpoint_url}".encode()).hexdigest()
        cache = cache_root / "listings" / f"{digest}.json"
        try:
            if fresh:
                raise OSError("listing again")
            cached = json.loads(cache.read_text())
            if time.time() - float(cached["listed_at"]) < ttl:
                return {
                    key: StoredObject(within + key, int(size), str(etag)) for key, (size, etag) in cached["objects"].items()
                }
        except (OSError, ValueError, KeyError, TypeError):
            pass
    try:
        listed = list_keys(source.filesystem(), base)
    except Exception as exc:  # noqa: BLE001
        raise remote_error(exc, source, role) from exc
    objects = {
        entry.key[len(within):]: entry
        for entry in listed
        if entry.key.startswith(within) and not entry.key.endswith("/")
    }
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = cache.with_suffix(f".{os.getpid()}.tmp")
        listing = {key: [found.size, found.version] for key, found in objects.items()}
        staging.write_text(json.dumps({"listed_at": time.time(), "objects": listing}))
        os.replace(staging, cache)
    return objects


def list_keys(fs: Any, base: str) -> list[StoredObject]:
    """Every object whose key starts with ``base`` (``bucket/prefix/``), as ListObjectsV2 gives
    them (:meth:`StoredObject.listed`). The first page (1,000 keys) is read alone; when there
    are more, the rest of the key space is cut into :data:`LIST_THREADS` ranges at keys that
    continue the last key's trailing number by a page each (``part-000999`` -> ``part-001999``,
    ``part-002999``, ...), listed concurrently, each paginated. Any key falls in exactly one
    range (``(after, until]``), so the listing is complete whatever the names; the cuts only
    decide how evenly it is shared."""
    bucket, _, prefix = base.partition("/")
    first = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=_PAGE)
    objects = [StoredObject.listed(entry) for entry in first.get("Contents", [])]
    if not first.get("IsTruncated") or not objects:
        return objects
    last = objects[-1].key
    cuts = _cuts_after(last, LIST_THREADS - 1)

    def walk(after: str, until: str | None) -> list[StoredObject]:
        found: list[StoredObject] = []
        token = None
        while True:
            options: dict[str, str | int] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": _PAGE}
            options.update({"ContinuationToken": token} if token else {"StartAfter": after})
            page = fs.call_s3("list_objects_v2", **options)
            for entry in map(StoredObject.listed, page.get("Contents", [])):
                if until is not None and entry.key > until:
                    return found
                found.append(entry)
            if not page.get("IsTruncated"):
                return found
            token = page["NextContinuationToken"]

    ranges = list(zip([last, *cuts], [*cuts, None]))
    with ThreadPoolExecutor(len(ranges)) as pool:
        for part in pool.map(lambda r: walk(*r), ranges):
            objects.extend(part)
    return objects


_PAGE = 1000
_TRAILING_NUMBER = re.compile(r"(\d+)(\D*)$")


def _cuts_after(last: str, count: int) -> list[str]:
    """Up to ``count`` keys after ``last``, increasing: its trailing number plus a page, two, ..."""
    match = _TRAILING_NUMBER.search(last)
    if match is None:
        return []
    digits, tail = match.group(1), match.group(2)
    head = last[: match.start()]
    cuts = []
    for step in range(1, count + 1):
        number = str(int(digits) + step * _PAGE).zfill(len(digits))
        if len(number) > len(digits):
            break
        cuts.append(f"{head}{number}{tail}")
    return cuts


def prefix_shards(source: RemoteSource, objects: dict[str, StoredObject]) -> list[ShardRef] | None:
    """The shards of a listed prefix, sorted by relative key, when it holds shards and no
    image or array objects; None otherwise (an image prefix, say)."""
    from bnrecal.workers.data.formats.images import is_ignored_part, is_image_name

    names = [n for n in objects if not any(is_ignored_part(p) for p in n.split("/"))]
    shards = sorted(n for n in names if is_shard_name(n))
    if not shards or any(is_image_name(n) or n.lower().endswith((".npy", ".npz", ".zip")) for n in names):
        return None
    check_one_split(shards, source.uri)
    return [objects[name].shard(source.uri, name) for name in shards]

