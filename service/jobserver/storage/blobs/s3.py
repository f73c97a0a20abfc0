"""The blob store in S3-compatible object storage, :class:`S3BlobStore`, for a replicated
service. It implements :class:`~.store.BlobStore` beside the files backend (:mod:`.files`),
not on top of it: the two share only :mod:`.shared`'s helpers.

``BNRECAL_BLOB_STORE=s3://bucket/prefix`` keeps every tenant's blobs at
``<prefix>/<tenant>/sha256/<hex[:2]>/<hex>``, content-addressed as on disk, with the
upload's file name at ``<prefix>/<tenant>/names/<hex>`` and the time it was last used
(an upload of the same bytes, a submission) as an empty marker object
``<prefix>/<tenant>/used/<hex>`` (an object's own ``LastModified`` cannot be refreshed
without rewriting it). An upload is still hashed into a local staging file as it streams
in (memory does not grow with its size), then put (multipart, by s3fs, when large) under
its digest, so an object is complete or absent. Each replica keeps a local cache of the
blobs it reads (its data dir's ``blobs`` folder, :class:`_LocalCache`): ``path()`` checks
the object still exists (a blob another replica deleted is gone here too), fetches it once
if it is not cached, and returns the cached file, which the job driver reads and downloads
are served from, with ``ETag`` and ``Range``, like a local blob.

Integrity (docs/storage.md, "Stored bytes are verified"): a fetched object is hashed
before it becomes the cached copy; an object whose bytes do not hash to its key's digest is
moved to ``<prefix>/<tenant>/quarantine/`` (``HEAD`` then 404) and the next upload of the
right bytes puts it again. Objects up to s3fs's single-part size are put with their
SHA-256 as S3's own checksum (``ChecksumSHA256``): S3 checks the bytes it receives against
it, and the scrub compares the checksum S3 keeps with the digest instead of downloading
the object. A damaged cached copy is dropped and fetched again.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from bnrecal.errors import BnrecalError, CorruptBlobError, NotFoundError, SpecError
from bnrecal.workers.data.storage.objectstore import s3_filesystem

from bnrecal.workers.files import file_digest
from bnrecal.service.jobserver.storage.blobs.shared import (
    WRITE_CHUNK,
    Staging,
    adopt_file,
    blob_hex,
    blob_key,
    checked_hex,
    corrupt_error,
    is_tenant,
    missing,
    named,
    side_key,
    tenant_folder,
    verified_chunks,
    write_hashed,
)
from bnrecal.service.jobserver.storage.blobs.store import BlobInfo, CorruptHook, StoredBlob, WriteChunks, clean_filename, is_digest

log = logging.getLogger("bnrecal.blobs")


def parse_blob_store(uri: str) -> tuple[str, str]:
    """The bucket and key prefix of ``s3://bucket/prefix``; a ``SpecError`` naming the setting otherwise."""
    if not uri.startswith("s3://") or not uri[5:].split("/", 1)[0]:
        raise SpecError(f"BNRECAL_BLOB_STORE must look like s3://bucket/prefix, not {uri!r}")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.strip("/")


class _LocalCache:
    """This replica's copies of the bucket's blobs, under ``root`` in the same layout as the
    files backend (``<tenant>/sha256/<hex[:2]>/<hex>``).

    It exists because readers need a local file: :meth:`S3BlobStore.path` returns the copy,
    the job driver reads it and downloads are served from it (``ETag``, ``Range``). It is
    never the truth, the bucket is: a copy is made only of bytes hashed to their digest (a
    fetch, or an upload just put), and dropped when its object is gone or either is found
    damaged."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def file(self, tenant: str, hex_digest: str) -> Path:
        """Where the copy of a tenant's blob is (or would be)."""
        return self.root / blob_key(tenant, hex_digest)

    def keep(self, tenant: str, hex_digest: str, source: Path) -> Path:
        """Move a local file with the blob's (hashed) bytes in as its copy; the copy."""
        cached = self.file(tenant, hex_digest)
        cached.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, cached)
        return cached

    def drop(self, tenant: str, hex_digest: str) -> None:
        """Forget the copy of a tenant's blob, if there is one."""
        self.file(tenant, hex_digest).unlink(missing_ok=True)


class S3BlobStore:
    """Blobs in a bucket under a prefix, one namespace per tenant, cached locally under
    ``cache_root`` (a :class:`~.store.BlobStore`)."""

    medium = "in the object store"
    """Where a damaged blob was damaged, for its error message."""

    def __init__(
        self, uri: str, cache_root: Path, endpoint_url: str | None = None, write_chunks: WriteChunks | None = None
    ) -> None:
        self._cache = _LocalCache(Path(cache_root))
        self._staging = Staging(Path(cache_root) / ".staging")
        self.write_chunks: WriteChunks = write_chunks or write_hashed
        self.on_corrupt: CorruptHook | None = None
        self.uri = uri
        bucket, prefix = parse_blob_store(uri)
        self._base = f"{bucket}/{prefix}" if prefix else bucket
        self.fs: Any = s3_filesystem(endpoint_url)
        if not self.fs.exists(bucket):
            raise SpecError(f"BNRECAL_BLOB_STORE: bucket {bucket!r} does not exist or is not reachable")

    # -- reading -------------------------------------------------------------------------

    def path(self, tenant: str, digest: str) -> Path:
        """The local copy of a tenant's blob, fetched (and hashed) once; ``NotFoundError`` if the
        bucket has no such blob, ``CorruptBlobError`` (quarantined) if its bytes do not match."""
        return self._fetch(tenant, digest, None, "job")

    def _fetch(self, tenant: str, digest: str, field: str | None, where: str) -> Path:
        hex_digest = checked_hex(digest)
        key = self._key(tenant, hex_digest)
        try:
            entry = self._info(key, refresh=True)
        except FileNotFoundError:
            self._cache.drop(tenant, hex_digest)  # deleted elsewhere: not served here
            raise missing(digest) from None
        cached = self._cache.file(tenant, hex_digest)
        if cached.is_file() and cached.stat().st_size == entry.size:
            return cached
        handle, fetched = self._staging.new_file(prefix="fetch-")
        handle.close()
        try:
            self.fs.get_file(key, str(fetched))
            if file_digest(fetched) != digest:
                raise self._bucket_corrupt(tenant, digest, where, field, entry.etag)
            return self._cache.keep(tenant, hex_digest, fetched)
        finally:
            fetched.unlink(missing_ok=True)

    def check(self, tenant: str, digest: str, field: str | None = None, where: str = "job") -> Path:
        """The cached copy once hashed and matching; a damaged cached copy is fetched again, and
        an object whose own bytes do not match is quarantined (``CorruptBlobError``)."""
        file = self._fetch(tenant, digest, field, where)
        if file_digest(file) == digest:
            return file
        log.warning("the cached copy of blob %s of %s was damaged: fetching it again", digest, tenant)
        file.unlink(missing_ok=True)
        return self._fetch(tenant, digest, field, where)

    def verified_chunks(self, tenant: str, digest: str, handle: BinaryIO, chunk_size: int = WRITE_CHUNK) -> Iterator[bytes]:
        """The bytes of an open cached copy in chunks, hashed as they are read; the last chunk is
        held back until the digest is known, and a mismatch raises ``CorruptBlobError`` instead
        (:meth:`corrupt`: the copy dropped, the bucket's object looked at)."""

        def damaged(inode: int) -> CorruptBlobError:
            return self.corrupt(tenant, digest, "download", inode=inode)

        return verified_chunks(handle, digest, damaged, chunk_size)

    def corrupt(
        self, tenant: str, digest: str, where: str, field: str | None = None, inode: int | None = None
    ) -> CorruptBlobError:
        """Bytes read from the cached copy did not match: drop it and look at the bucket's
        object; quarantine that too if its bytes are wrong. The error to raise either way (the
        read that found it is cut off). ``inode`` is not needed: the copy is dropped whatever
        file it is now."""
        self._cache.drop(tenant, digest.removeprefix("sha256:"))
        try:
            self._fetch(tenant, digest, field, where)
        except CorruptBlobError as exc:
            return exc
        except NotFoundError:
            pass
        log.warning("the cached copy of blob %s of %s was damaged (found by %s): dropped", digest, tenant, where)
        if self.on_corrupt is not None:
            self.on_corrupt(where)
        return CorruptBlobError(
            f"the server's cached copy of blob {digest} was damaged; it was dropped and the object store's copy is "
            "intact: retry", field, digest,
        )

    def _bucket_corrupt(
        self, tenant: str, digest: str, where: str, field: str | None, etag: str | None
    ) -> CorruptBlobError:
        """The bucket's object does not hash to its digest: quarantine it (unless it was put
        again meanwhile, its ETag changed), drop the cached copy, and the error naming it."""
        hex_digest = digest.removeprefix("sha256:")
        key = self._key(tenant, hex_digest)
        self._cache.drop(tenant, hex_digest)
        try:
            if etag is None or self._info(key, refresh=True).etag == etag:
                aside = f"{self._base}/{tenant}/quarantine/{hex_digest}.{time.time_ns()}"
                self.fs.copy(key, aside)
                self.fs.rm_file(key)
        except FileNotFoundError:
            pass
        return corrupt_error(tenant, digest, where, field, self.filename(tenant, digest), self.medium, self.on_corrupt)

    def object_checksum(self, tenant: str, digest: str) -> str | None:
        """The SHA-256 S3 keeps for the object (``sha256:<hex>``), None where the store keeps
        none (a multipart upload, a store without checksums); ``NotFoundError`` if absent."""
        bucket, _, key = self._key(tenant, digest.removeprefix("sha256:")).partition("/")
        try:
            head = self.fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        except FileNotFoundError:
            raise missing(digest) from None
        encoded = head.get("ChecksumSHA256")
        if not encoded or "-" in encoded:  # absent, or a composite of a multipart upload's parts
            return None
        return "sha256:" + base64.b64decode(encoded).hex()

    def scrub(self, tenant: str, digest: str) -> int:
        """Check one blob for the periodic scrub: S3's own checksum where it keeps one, else the
        object downloaded and hashed; a cached copy is hashed too. The bytes read; a mismatch
        quarantines the blob and raises ``CorruptBlobError``."""
        read = 0
        cached = self._cache.file(tenant, digest.removeprefix("sha256:"))
        if cached.is_file():
            read += cached.stat().st_size
            if file_digest(cached) != digest:
                raise self.corrupt(tenant, digest, "scrub")
        checksum = self.object_checksum(tenant, digest)
        if checksum is not None:
            if checksum != digest:
                raise self._bucket_corrupt(tenant, digest, "scrub", None, None)
            return read
        if not cached.is_file():
            read += self._fetch(tenant, digest, None, "scrub").stat().st_size  # fetched and hashed
        return read

    def info(self, tenant: str, digest: str) -> BlobInfo:
        """Digest, size and file name of a tenant's blob, from the bucket (``NotFoundError`` if absent)."""
        hex_digest = checked_hex(digest)
        try:
            size = self._info(self._key(tenant, hex_digest)).size
        except FileNotFoundError:
            raise missing(digest) from None
        return BlobInfo(digest, size, self.filename(tenant, digest))

    def filename(self, tenant: str, digest: str) -> str | None:
        """The file name the tenant's blob was last uploaded with; None if it came without one."""
        if not is_digest(digest):
            return None
        try:
            stored = self.fs.cat_file(self._side(tenant, "names", digest.removeprefix("sha256:"))).decode("utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        return clean_filename(stored)

    def exists(self, tenant: str, digest: str) -> bool:
        """Whether the tenant holds this blob in the bucket."""
        return is_digest(digest) and bool(self.fs.exists(self._key(tenant, digest.removeprefix("sha256:"))))

    def last_used(self, tenant: str, digest: str) -> float:
        """When the blob was stored or last used (epoch seconds); ``NotFoundError`` if absent."""
        hex_digest = digest.removeprefix("sha256:")
        try:
            stored = self._info(self._key(tenant, hex_digest)).modified
        except FileNotFoundError:
            raise missing(digest) from None
        try:
            return max(stored, self._info(self._side(tenant, "used", hex_digest)).modified)
        except FileNotFoundError:
            return stored

    # -- writing and deleting ------------------------------------------------------------------

    async def ingest(
        self,
        tenant: str,
        chunks: AsyncIterator[bytes],
        max_bytes: int,
        filename: str | None = None,
        over_limit: Callable[[int], BnrecalError] | None = None,
    ) -> BlobInfo:
        """Store a streamed upload: hashed into a local staging file as it arrives (the cap
        enforced on the bytes received, ``PayloadTooLargeError`` or ``over_limit(bytes
        received)`` past ``max_bytes``, nothing kept), then put under its digest and kept as
        this replica's cached copy. ``filename`` is remembered beside the object."""

        def keep(staged: Path, info: BlobInfo) -> BlobInfo:
            self._place(tenant, staged, info)
            return named(info, filename, partial(self._remember_name, tenant, info.hex), partial(self.filename, tenant, info.digest))

        return await self._staging.receive(chunks, max_bytes, over_limit, self.write_chunks, keep)

    def adopt(self, tenant: str, file: Path) -> BlobInfo:
        """Put a finished local file (a job artifact) in the bucket as one of the tenant's blobs,
        hashed where it lies; the file itself becomes this replica's cached copy (copied through
        the staging folder only if it is on another file system than the cache)."""
        return adopt_file(file, self._staging, partial(self._place, tenant))

    def touch(self, tenant: str, digest: str) -> None:
        """Mark a blob as just used, so the collector keeps it a full retention period."""
        if self.exists(tenant, digest):
            self.fs.pipe_file(self._side(tenant, "used", digest.removeprefix("sha256:")), b"")

    def remove(self, tenant: str, digest: str) -> int:
        """Delete a tenant's blob, its name and use marker, and the local copy; the bytes freed (0 if absent)."""
        if not is_digest(digest):
            return 0
        hex_digest = digest.removeprefix("sha256:")
        key = self._key(tenant, hex_digest)
        try:
            size = self._info(key).size
            self.fs.rm_file(key)
        except FileNotFoundError:
            return 0
        for kind in ("names", "used"):
            try:
                self.fs.rm_file(self._side(tenant, kind, hex_digest))
            except FileNotFoundError:
                pass
        self._cache.drop(tenant, hex_digest)
        return size

    # -- listing and staging -------------------------------------------------------------

    def tenants(self) -> list[str]:
        """The tenants that have blobs under the prefix."""
        try:
            entries = self.fs.ls(self._base, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)
        return sorted(name for name in names if is_tenant(name))

    def stored(self, tenant: str) -> Iterator[StoredBlob]:
        """Every blob of a tenant, in digest order: its object's size, and its last use (the
        later of the object's time and its ``used`` marker's)."""
        tenant_folder(tenant)  # a malformed tenant id is a ValueError, before any listing
        used = {
            key.rsplit("/", 1)[-1]: entry.modified for key, entry in self._find(f"{self._base}/{tenant}/used").items()
        }
        for key, entry in sorted(self._find(f"{self._base}/{tenant}/sha256").items()):
            hex_digest = blob_hex(key.rsplit("/", 1)[-1])
            if hex_digest is not None:
                mtime = max(entry.modified, used.get(hex_digest, 0.0))
                yield StoredBlob("sha256:" + hex_digest, entry.size, mtime)

    def staging_files(self) -> list[Path]:
        """The files in the local staging folder: uploads and fetches in progress, or ones a crash left behind."""
        return self._staging.files()

    def clear_staging(self) -> None:
        """Remove uploads and fetches a crash left half written (called at start-up)."""
        self._staging.clear()

    def _place(self, tenant: str, staged: Path, info: BlobInfo) -> None:
        """Put a complete, hashed local file under its content address, and keep it as this
        replica's cached copy."""
        # Put even when the key exists: the object may have been damaged since (an upload heals it).
        self.fs.put_file(str(staged), self._key(tenant, info.hex), **_checksum_arguments(info))
        self._cache.keep(tenant, info.hex, staged)

    def _remember_name(self, tenant: str, hex_digest: str, name: str) -> None:
        self.fs.pipe_file(self._side(tenant, "names", hex_digest), name.encode("utf-8"))

    # -- keys --------------------------------------------------------------------------------

    def _key(self, tenant: str, hex_digest: str) -> str:
        """The object of a tenant's blob: ``<bucket>/<prefix>/<tenant>/sha256/<hex[:2]>/<hex>``."""
        return f"{self._base}/{blob_key(tenant, hex_digest)}"

    def _side(self, tenant: str, kind: str, hex_digest: str) -> str:
        """The object of a record about a tenant's blob (``names``, ``used``)."""
        return f"{self._base}/{side_key(tenant, kind, hex_digest)}"

    def _info(self, key: str, refresh: bool = False) -> ObjectEntry:
        """The object at ``key`` (``FileNotFoundError`` if absent)."""
        return ObjectEntry.of(self.fs.info(key, refresh=refresh))

    def _find(self, folder: str) -> dict[str, ObjectEntry]:
        """Every object under ``folder``, by key (none when it is absent)."""
        try:
            found = self.fs.find(folder, detail=True)
        except FileNotFoundError:
            return {}
        return {key: ObjectEntry.of(entry) for key, entry in found.items()}


def _checksum_arguments(info: BlobInfo) -> dict[str, str]:
    """``ChecksumSHA256`` for an object s3fs puts in one request (S3 checks the bytes against
    it and keeps it); nothing for a multipart upload, whose checksum would be of its parts."""
    from s3fs.core import calculate_chunksize

    if info.size >= min(5 * 2**30, 2 * calculate_chunksize(info.size)):
        return {}
    return {"ChecksumSHA256": base64.b64encode(bytes.fromhex(info.hex)).decode("ascii")}


@dataclass(frozen=True)
class ObjectEntry:
    """What the bucket says of one object: its size, when it was last written (epoch seconds,
    0 where the listing has no time) and its ``ETag`` (None where it has none)."""

    size: int
    modified: float
    etag: str | None

    @classmethod
    def of(cls, entry: dict[str, Any]) -> ObjectEntry:
        """The object as s3fs's ``info``/``find`` describes it (botocore's keys, or fsspec's)."""
        modified = entry.get("LastModified") or entry.get("last_modified")
        epoch = modified.timestamp() if isinstance(modified, datetime) else float(modified or 0.0)
        return cls(size=int(entry["size"]), modified=epoch, etag=entry.get("ETag"))
