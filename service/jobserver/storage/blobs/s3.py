"""The blob store's second backend: S3-compatible object storage, for a replicated service.

``BNRECAL_BLOB_STORE=s3://bucket/prefix`` keeps every tenant's blobs at
``<prefix>/<tenant>/sha256/<hex[:2]>/<hex>``, content-addressed as on disk, with the
upload's file name at ``<prefix>/<tenant>/names/<hex>`` and the time it was last used
(an upload of the same bytes, a submission) as an empty marker object
``<prefix>/<tenant>/used/<hex>`` (an object's own ``LastModified`` cannot be refreshed
without rewriting it). The interface is :class:`service.jobserver.storage.blobs.BlobStore`'s: an upload is
still hashed into a local staging file as it streams in (memory does not grow with its
size), then put (multipart, by s3fs, when large) under its digest, so an object is
complete or absent. Each replica keeps a local cache of the blobs it reads (its data
dir's ``blobs`` folder): ``path()`` checks the object still exists (a blob another replica
deleted is gone here too), fetches it once if it is not cached, and returns the cached
file, which the job driver reads and downloads are served from, with ``ETag`` and
``Range``, like a local blob.

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
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from bnrecal.workers.data.objectstore import s3_filesystem
from bnrecal.errors import CorruptBlobError, NotFoundError, SpecError

from bnrecal.service.jobserver.storage.blobs.files import _DIGEST, _TENANT, BlobInfo, BlobStore, StoredBlob, WriteChunks, clean_filename, file_digest, is_digest

log = logging.getLogger("bnrecal.blobs")


def parse_blob_store(uri: str) -> tuple[str, str]:
    """The bucket and key prefix of ``s3://bucket/prefix``; a ``SpecError`` naming the setting otherwise."""
    if not uri.startswith("s3://") or not uri[5:].split("/", 1)[0]:
        raise SpecError(f"BNRECAL_BLOB_STORE must look like s3://bucket/prefix, not {uri!r}")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.strip("/")


class S3BlobStore(BlobStore):
    """Blobs in a bucket under a prefix, one namespace per tenant, cached locally under ``cache_root``."""

    def __init__(
        self, uri: str, cache_root: Path, endpoint_url: str | None = None, write_chunks: WriteChunks | None = None
    ) -> None:
        super().__init__(cache_root, write_chunks)
        self.uri = uri
        bucket, prefix = parse_blob_store(uri)
        self._base = f"{bucket}/{prefix}" if prefix else bucket
        self.fs: Any = s3_filesystem(endpoint_url)
        if not self.fs.exists(bucket):
            raise SpecError(f"BNRECAL_BLOB_STORE: bucket {bucket!r} does not exist or is not reachable")

    # -- reading -------------------------------------------------------------------------

    medium = "in the object store"

    def path(self, tenant: str, digest: str) -> Path:
        """The local copy of a tenant's blob, fetched (and hashed) once; ``NotFoundError`` if the
        bucket has no such blob, ``CorruptBlobError`` (quarantined) if its bytes do not match."""
        return self._fetch(tenant, digest, None, "job")

    def _fetch(self, tenant: str, digest: str, field: str | None, where: str) -> Path:
        if not is_digest(digest):
            raise NotFoundError(f"no blob {digest!r}: a digest looks like sha256:<64 hex digits>")
        hex_digest = digest.removeprefix("sha256:")
        key = self._key(tenant, "sha256", hex_digest)
        try:
            entry = self.fs.info(key, refresh=True)
        except FileNotFoundError:
            self._location(tenant, hex_digest).unlink(missing_ok=True)  # deleted elsewhere: not served here
            raise NotFoundError(f"no blob {digest} for this API key") from None
        cached = self._location(tenant, hex_digest)
        if cached.is_file() and cached.stat().st_size == int(entry["size"]):
            return cached
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="fetch-", suffix=".part", dir=self._staging)
        os.close(fd)
        try:
            self.fs.get_file(key, name)
            if file_digest(Path(name)) != digest:
                raise self._bucket_corrupt(tenant, digest, where, field, entry.get("ETag"))
            os.replace(name, cached)
        finally:
            Path(name).unlink(missing_ok=True)
        return cached

    def check(self, tenant: str, digest: str, field: str | None = None, where: str = "job") -> Path:
        """The cached copy once hashed and matching; a damaged cached copy is fetched again, and
        an object whose own bytes do not match is quarantined (``CorruptBlobError``)."""
        file = self._fetch(tenant, digest, field, where)
        if file_digest(file) == digest:
            return file
        log.warning("the cached copy of blob %s of %s was damaged: fetching it again", digest, tenant)
        file.unlink(missing_ok=True)
        return self._fetch(tenant, digest, field, where)

    def corrupt(
        self, tenant: str, digest: str, where: str, field: str | None = None, inode: int | None = None
    ) -> CorruptBlobError:
        """Bytes read from the cached copy did not match: drop it and look at the bucket's
        object; quarantine that too if its bytes are wrong. The error to raise either way (the
        read that found it is cut off)."""
        self._location(tenant, digest.removeprefix("sha256:")).unlink(missing_ok=True)
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
        again meanwhile, its ETag changed), and the error naming it."""
        hex_digest = digest.removeprefix("sha256:")
        key = self._key(tenant, "sha256", hex_digest)
        self._location(tenant, hex_digest).unlink(missing_ok=True)
        try:
            if etag is None or self.fs.info(key, refresh=True).get("ETag") == etag:
                aside = f"{self._base}/{tenant}/quarantine/{hex_digest}.{time.time_ns()}"
                self.fs.copy(key, aside)
                self.fs.rm_file(key)
        except FileNotFoundError:
            pass
        return super().corrupt(tenant, digest, where, field)

    def _quarantine(self, tenant: str, digest: str, inode: int | None = None) -> None:
        """The local copy only (the bucket's object is moved aside by :meth:`_bucket_corrupt`)."""
        self._location(tenant, digest.removeprefix("sha256:")).unlink(missing_ok=True)

    def object_checksum(self, tenant: str, digest: str) -> str | None:
        """The SHA-256 S3 keeps for the object (``sha256:<hex>``), None where the store keeps
        none (a multipart upload, a store without checksums); ``NotFoundError`` if absent."""
        bucket, _, key = self._key(tenant, "sha256", digest.removeprefix("sha256:")).partition("/")
        try:
            head = self.fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        except FileNotFoundError:
            raise NotFoundError(f"no blob {digest} for this API key") from None
        encoded = head.get("ChecksumSHA256")
        if not encoded or "-" in encoded:  # absent, or a composite of a multipart upload's parts
            return None
        return "sha256:" + base64.b64decode(encoded).hex()

    def scrub(self, tenant: str, digest: str) -> int:
        """Check one blob for the periodic scrub: S3's own checksum where it keeps one, else the
        object downloaded and hashed; a cached copy is hashed too. The bytes read; a mismatch
        quarantines the blob and raises ``CorruptBlobError``."""
        read = 0
        cached = self._location(tenant, digest.removeprefix("sha256:"))
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
        if not is_digest(digest):
            raise NotFoundError(f"no blob {digest!r}: a digest looks like sha256:<64 hex digits>")
        try:
            size = int(self.fs.info(self._key(tenant, "sha256", digest.removeprefix("sha256:")))["size"])
        except FileNotFoundError:
            raise NotFoundError(f"no blob {digest} for this API key") from None
        return BlobInfo(digest, size, self.filename(tenant, digest))

    def filename(self, tenant: str, digest: str) -> str | None:
        """The file name the tenant's blob was last uploaded with; None if it came without one."""
        if not is_digest(digest):
            return None
        try:
            stored = self.fs.cat_file(self._key(tenant, "names", digest.removeprefix("sha256:"))).decode("utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        return clean_filename(stored)

    def exists(self, tenant: str, digest: str) -> bool:
        """Whether the tenant holds this blob in the bucket."""
        return is_digest(digest) and bool(self.fs.exists(self._key(tenant, "sha256", digest.removeprefix("sha256:"))))

    def last_used(self, tenant: str, digest: str) -> float:
        """When the blob was stored or last used (epoch seconds); ``NotFoundError`` if absent."""
        hex_digest = digest.removeprefix("sha256:")
        try:
            stored = _epoch(self.fs.info(self._key(tenant, "sha256", hex_digest)))
        except FileNotFoundError:
            raise NotFoundError(f"no blob {digest} for this API key") from None
        try:
            return max(stored, _epoch(self.fs.info(self._key(tenant, "used", hex_digest))))
        except FileNotFoundError:
            return stored

    # -- writing and deleting ------------------------------------------------------------------

    def touch(self, tenant: str, digest: str) -> None:
        """Mark a blob as just used, so the collector keeps it a full retention period."""
        if self.exists(tenant, digest):
            self.fs.pipe_file(self._key(tenant, "used", digest.removeprefix("sha256:")), b"")

    def remove(self, tenant: str, digest: str) -> int:
        """Delete a tenant's blob, its name and use marker, and the local copy; the bytes freed (0 if absent)."""
        if not is_digest(digest):
            return 0
        hex_digest = digest.removeprefix("sha256:")
        key = self._key(tenant, "sha256", hex_digest)
        try:
            size = int(self.fs.info(key)["size"])
            self.fs.rm_file(key)
        except FileNotFoundError:
            return 0
        for kind in ("names", "used"):
            try:
                self.fs.rm_file(self._key(tenant, kind, hex_digest))
            except FileNotFoundError:
                pass
        self._location(tenant, hex_digest).unlink(missing_ok=True)
        return size

    def tenants(self) -> list[str]:
        """The tenants that have blobs under the prefix."""
        try:
            entries = self.fs.ls(self._base, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)
        return sorted(name for name in names if _TENANT.match(name))

    def stored(self, tenant: str) -> Iterator[StoredBlob]:
        """Every blob of a tenant, in digest order: its object's size, and its last use (the
        later of the object's time and its ``used`` marker's)."""
        if not _TENANT.match(tenant):
            raise ValueError(f"invalid tenant id {tenant!r}")
        used = {
            key.rsplit("/", 1)[-1]: _epoch(entry) for key, entry in self._find(f"{self._base}/{tenant}/used").items()
        }
        for key, entry in sorted(self._find(f"{self._base}/{tenant}/sha256").items()):
            hex_digest = key.rsplit("/", 1)[-1]
            if _DIGEST.match("sha256:" + hex_digest):
                mtime = max(_epoch(entry), used.get(hex_digest, 0.0))
                yield StoredBlob("sha256:" + hex_digest, int(entry["size"]), mtime)

    def _place(self, tenant: str, staged: Path, info: BlobInfo) -> None:
        """Put a complete, hashed staging file under its content address (if absent: else mark it
        used), and keep it as this replica's cached copy."""
        key = self._key(tenant, "sha256", info.hex)
        # Put even when the key exists: the object may have been damaged since (an upload heals it).
        self.fs.put_file(str(staged), key, **_checksum_arguments(info))
        cached = self._location(tenant, info.hex)
        cached.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, cached)

    def _remember_name(self, tenant: str, hex_digest: str, name: str) -> None:
        self.fs.pipe_file(self._key(tenant, "names", hex_digest), name.encode("utf-8"))

    # -- keys --------------------------------------------------------------------------------

    def _key(self, tenant: str, kind: str, hex_digest: str) -> str:
        if not _TENANT.match(tenant):
            raise ValueError(f"invalid tenant id {tenant!r}")
        if kind == "sha256":
            return f"{self._base}/{tenant}/sha256/{hex_digest[:2]}/{hex_digest}"
        return f"{self._base}/{tenant}/{kind}/{hex_digest}"

    def _find(self, folder: str) -> dict[str, dict[str, Any]]:
        try:
            return self.fs.find(folder, detail=True)
        except FileNotFoundError:
            return {}


def open_blob_store(blob_store: str | None, local_root: Path, endpoint_url: str | None = None) -> BlobStore:
    """The blob store the settings name: files under ``local_root`` (the default), or the
    bucket of ``BNRECAL_BLOB_STORE`` with ``local_root`` as this process's cache of it."""
    if not blob_store:
        return BlobStore(local_root)
    return S3BlobStore(blob_store, local_root, endpoint_url)


def _checksum_arguments(info: BlobInfo) -> dict[str, str]:
    """``ChecksumSHA256`` for an object s3fs puts in one request (S3 checks the bytes against
    it and keeps it); nothing for a multipart upload, whose checksum would be of its parts."""
    from s3fs.core import calculate_chunksize

    if info.size >= min(5 * 2**30, 2 * calculate_chunksize(info.size)):
        return {}
    return {"ChecksumSHA256": base64.b64encode(bytes.fromhex(info.hex)).decode("ascii")}


def _epoch(entry: dict[str, Any]) -> float:
    modified = entry.get("LastModified") or entry.get("last_modified")
    if isinstance(modified, datetime):
        return modified.timestamp()
    return float(modified or 0.0)
