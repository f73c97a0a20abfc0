"""The content-addressed blob store: uploads, checkpoints, data and job artifacts, per tenant.

A blob lives at ``<root>/<tenant>/sha256/<hex[:2]>/<hex>``; its name is the SHA-256 of
its bytes, so the same bytes always get the same digest and a file is never rewritten.
Every write goes through a temporary file that is hashed while written, fsynced and
renamed into place, so a blob is either complete or absent, never half there.

Stored bytes are checked against their digest whenever they are read for use
(:meth:`BlobStore.check`, :meth:`BlobStore.verified_chunks`; docs/api.md, "Blobs"): a blob
whose bytes no longer match is moved aside to ``<root>/.quarantine/<tenant>/`` (so
``exists`` is false and ``HEAD`` answers 404), and the next upload of the right bytes
stores it again. An upload of bytes already stored replaces the stored file with the new,
freshly hashed one, so it heals a blob damaged since, found or not.

An upload may come with a file name, kept beside the blob in
``<root>/<tenant>/names/<hex>`` (the name of the latest upload of those bytes that gave
one). It is only ever shown, in messages about the blob; it never becomes a path. A
store written before names existed simply has none.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
import unicodedata
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import anyio

from bnrecal.errors import BnrecalError, CorruptBlobError, InsufficientStorageError, NotFoundError, PayloadTooLargeError
from bnrecal.workers.files import atomic_write, sync_directory

log = logging.getLogger("bnrecal.blobs")

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
_DIGEST = re.compile(DIGEST_PATTERN)
_TENANT = re.compile(r"^[0-9a-z_-]{1,64}$")
_WRITE_CHUNK = 1024 * 1024  # bytes gathered before one write (and one thread hop)
MAX_FILENAME_CHARS = 255
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

WriteChunks = Callable[[BinaryIO, "hashlib._Hash", list[bytes]], None]
"""The write layer of uploads: hash and write chunks to the staged file (replaceable in tests)."""

CorruptHook = Callable[[str], None]
"""Told where a corrupt blob was found (``download``, ``job``, ``scrub``, ``submission``): the metrics."""

QUARANTINE = ".quarantine"
"""The folder under the store's root where corrupt blobs are moved aside (kept for inspection)."""


def file_digest(file: Path) -> str:
    """The ``sha256:<hex>`` digest of a file's bytes, read in blocks."""
    with open(file, "rb") as handle:
        return "sha256:" + hashlib.file_digest(handle, "sha256").hexdigest()


@dataclass(frozen=True)
class BlobInfo:
    """A stored blob: its digest (``sha256:<hex>``), size in bytes and the file name it was uploaded with."""

    digest: str
    size: int
    filename: str | None = None

    @property
    def hex(self) -> str:
        """The bare hex SHA-256."""
        return self.digest.removeprefix("sha256:")


@dataclass(frozen=True)
class StoredBlob:
    """A blob as a listing of a tenant's store sees it: its digest, its size in bytes and
    when it was last used (written, uploaded again or submitted; epoch seconds): what
    storage collection and quotas decide by, the same for both backends."""

    digest: str
    size: int
    last_used: float


def is_digest(value: str) -> bool:
    """Whether ``value`` is a well-formed ``sha256:<64 hex>`` digest."""
    return bool(_DIGEST.match(value))


def clean_filename(raw: str | None) -> str | None:
    """A client's file name made safe to show: its last path component (``/`` or ``\\``),
    without control, format (bidi) or unassigned characters, trimmed, at most
    ``MAX_FILENAME_CHARS`` characters; None when nothing (or only ``.``/``..``) is left."""
    if not raw:
        return None
    name = unicodedata.normalize("NFC", raw).replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(char for char in name if not unicodedata.category(char).startswith("C")).strip()
    if name in ("", ".", ".."):
        return None
    return name[:MAX_FILENAME_CHARS]


class BlobStore:
    """Blobs on the local file system, one namespace per tenant."""

    medium = "on the server's disk"
    """Where a damaged blob was damaged, for its error message."""

    def __init__(self, root: Path, write_chunks: WriteChunks | None = None) -> None:
        self.root = Path(root)
        self.write_chunks: WriteChunks = write_chunks or _write_hashed
        self.on_corrupt: CorruptHook | None = None
        self._staging = self.root / ".staging"
        self._staging.mkdir(parents=True, exist_ok=True)

    def path(self, tenant: str, digest: str) -> Path:
        """The file of a tenant's blob; ``NotFoundError`` if the tenant has no such blob."""
        if not is_digest(digest):
            raise NotFoundError(f"no blob {digest!r}: a digest looks like sha256:<64 hex digits>")
        file = self._location(tenant, digest.removeprefix("sha256:"))
        if not file.is_file():
            raise NotFoundError(f"no blob {digest} for this API key")
        return file

    def info(self, tenant: str, digest: str) -> BlobInfo:
        """Digest, size and file name of a tenant's blob (``NotFoundError`` if absent)."""
        size = self.path(tenant, digest).stat().st_size
        return BlobInfo(digest, size, self.filename(tenant, digest))

    def filename(self, tenant: str, digest: str) -> str | None:
        """The file name the tenant's blob was last uploaded with; None if it came without one."""
        if not is_digest(digest):
            return None
        try:
            stored = self._name_location(tenant, digest.removeprefix("sha256:")).read_text("utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        return clean_filename(stored)

    def exists(self, tenant: str, digest: str) -> bool:
        """Whether the tenant holds this blob."""
        return is_digest(digest) and self._location(tenant, digest.removeprefix("sha256:")).is_file()

    # -- verified reads ------------------------------------------------------------------

    def check(self, tenant: str, digest: str, field: str | None = None, where: str = "job") -> Path:
        """The blob's file once its bytes are hashed and match its digest: what a job reads.

        A mismatch quarantines the blob and raises ``CorruptBlobError`` naming it (and the spec
        ``field`` that names it), which says to upload it again."""
        file = self.path(tenant, digest)
        try:
            inode = file.stat().st_ino
            good = file_digest(file) == digest
        except FileNotFoundError:  # removed meanwhile (deleted, quarantined by another reader)
            raise NotFoundError(f"no blob {digest} for this API key") from None
        if not good:
            raise self.corrupt(tenant, digest, where, field, inode)
        return file

    def verified_chunks(self, tenant: str, digest: str, handle: BinaryIO, chunk_size: int = _WRITE_CHUNK) -> Iterator[bytes]:
        """The bytes of an open blob file in chunks, hashed as they are read; the last chunk is
        held back until the digest is known, and a mismatch raises ``CorruptBlobError`` (the
        blob quarantined) instead, so a reader never gets all of a damaged blob."""
        inode = os.fstat(handle.fileno()).st_ino
        hashed = hashlib.sha256()
        held: bytes | None = None
        while block := handle.read(chunk_size):
            hashed.update(block)
            if held is not None:
                yield held
            held = block
        if "sha256:" + hashed.hexdigest() != digest:
            raise self.corrupt(tenant, digest, "download", inode=inode)
        if held is not None:
            yield held

    def corrupt(
        self, tenant: str, digest: str, where: str, field: str | None = None, inode: int | None = None
    ) -> CorruptBlobError:
        """Bytes read from a blob did not hash to its digest: quarantine it (``HEAD`` then 404,
        so clients upload it again), count it, and return the error to raise. ``inode`` is the
        file the bad bytes came from: a file replaced since (healed by an upload) stays."""
        name = self.filename(tenant, digest)
        self._quarantine(tenant, digest, inode)
        log.error("blob %s of %s (%s) is corrupt (found by %s): quarantined", digest, tenant, name or "no name", where)
        if self.on_corrupt is not None:
            self.on_corrupt(where)
        return CorruptBlobError(_corrupt_message(digest, name, field, self.medium), field, digest)

    def _quarantine(self, tenant: str, digest: str, inode: int | None = None) -> None:
        hex_digest = digest.removeprefix("sha256:")
        file = self._location(tenant, hex_digest)
        try:
            if inode is not None and file.stat().st_ino != inode:
                return  # already replaced by good bytes (an upload healed it)
            aside = self.root / QUARANTINE / tenant / f"{hex_digest}.{time.time_ns()}"
            aside.parent.mkdir(parents=True, exist_ok=True)
            os.replace(file, aside)
        except FileNotFoundError:
            return

    def scrub(self, tenant: str, digest: str) -> int:
        """Check one stored blob for the periodic scrub: the bytes read; a mismatch quarantines
        it and raises ``CorruptBlobError``."""
        return self.check(tenant, digest, where="scrub").stat().st_size

    def quarantined(self) -> list[Path]:
        """The corrupt blobs moved aside so far (for operators; the collector leaves them)."""
        folder = self.root / QUARANTINE
        return sorted(path for path in folder.rglob("*") if path.is_file()) if folder.is_dir() else []

    async def ingest(
        self,
        tenant: str,
        chunks: AsyncIterator[bytes],
        max_bytes: int,
        filename: str | None = None,
        over_limit: Callable[[int], BnrecalError] | None = None,
    ) -> BlobInfo:
        """Store a streamed upload, hashing it as it arrives; memory use does not grow with its size.

        The byte cap is enforced on the bytes actually received: the upload stops with
        ``PayloadTooLargeError`` (or ``over_limit(bytes received)``, e.g. a quota's error)
        at the first chunk past ``max_bytes`` and nothing of it stays on disk. A disk that
        fills up is an ``InsufficientStorageError``, again with nothing kept. ``filename``
        (cleaned by :func:`clean_filename`) is remembered for messages; an upload without
        one keeps the name the bytes had.
        """
        digest = hashlib.sha256()
        size = 0
        handle, staged = self._staging_file()
        pending: list[bytes] = []
        pending_bytes = 0
        try:
            with handle:
                async for chunk in chunks:
                    if not chunk:
                        continue
                    size += len(chunk)
                    if size > max_bytes:
                        if over_limit is not None:
                            raise over_limit(size)
                        raise PayloadTooLargeError(
                            f"upload exceeds the limit of {max_bytes} bytes (BNRECAL_MAX_UPLOAD_BYTES)"
                        )
                    pending.append(chunk)
                    pending_bytes += len(chunk)
                    if pending_bytes >= _WRITE_CHUNK:
                        await anyio.to_thread.run_sync(self.write_chunks, handle, digest, pending)
                        pending, pending_bytes = [], 0
                await anyio.to_thread.run_sync(self.write_chunks, handle, digest, pending)
                await anyio.to_thread.run_sync(_flush_and_sync, handle)
            info = BlobInfo(f"sha256:{digest.hexdigest()}", size)
            await anyio.to_thread.run_sync(self._place, tenant, staged, info)
            name = clean_filename(filename)
            if name is not None:
                await anyio.to_thread.run_sync(self._remember_name, tenant, info.hex, name)
            return BlobInfo(info.digest, size, name or self.filename(tenant, info.digest))
        except OSError as exc:
            _raise_if_disk_full(exc, f"upload of {size} bytes")
            raise
        finally:
            staged.unlink(missing_ok=True)

    def adopt(self, tenant: str, file: Path) -> BlobInfo:
        """Move a finished file (a job artifact) into the store as one of the tenant's blobs.

        The file is hashed where it lies and renamed into place (docs/storage.md, "A full
        disk"): storing an artifact needs no room beside it. Only a file on another file
        system is copied (through a staging file, hashed as written)."""
        try:
            with open(file, "r+b") as handle:
                os.fsync(handle.fileno())  # durable before its name says it is complete
                info = BlobInfo("sha256:" + hashlib.file_digest(handle, "sha256").hexdigest(), os.fstat(handle.fileno()).st_size)
            try:
                self._place(tenant, file, info)
                return info
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
            return self._adopt_copy(tenant, file)
        except OSError as exc:
            _raise_if_disk_full(exc, f"storing {file.name}", resource="blob store")
            raise

    def _adopt_copy(self, tenant: str, file: Path) -> BlobInfo:
        digest = hashlib.sha256()
        handle, staged = self._staging_file()
        try:
            with handle, open(file, "rb") as source:
                size = 0
                while block := source.read(_WRITE_CHUNK):
                    digest.update(block)
                    handle.write(block)
                    size += len(block)
                _flush_and_sync(handle)
            info = BlobInfo(f"sha256:{digest.hexdigest()}", size)
            self._place(tenant, staged, info)
            return info
        finally:
            staged.unlink(missing_ok=True)

    def last_used(self, tenant: str, digest: str) -> float:
        """When the blob was stored or last used (its mtime); ``NotFoundError`` if absent."""
        return self.path(tenant, digest).stat().st_mtime

    def touch(self, tenant: str, digest: str) -> None:
        """Mark a blob as just used (its mtime), so the collector keeps it a full retention period."""
        if self.exists(tenant, digest):
            os.utime(self._location(tenant, digest.removeprefix("sha256:")))

    def remove(self, tenant: str, digest: str) -> int:
        """Delete a tenant's blob and its remembered name; the bytes freed (0 if it was absent)."""
        if not is_digest(digest):
            return 0
        hex_digest = digest.removeprefix("sha256:")
        file = self._location(tenant, hex_digest)
        try:
            size = file.stat().st_size
            file.unlink()
        except FileNotFoundError:
            return 0
        self._name_location(tenant, hex_digest).unlink(missing_ok=True)
        return size

    def tenants(self) -> list[str]:
        """The tenants that have a folder in the store."""
        if not self.root.is_dir():
            return []
        return sorted(entry.name for entry in self.root.iterdir() if entry.is_dir() and _TENANT.match(entry.name))

    def stored(self, tenant: str) -> Iterator[StoredBlob]:
        """Every blob of a tenant, in digest order (its file's size and mtime)."""
        top = self.root / tenant / "sha256"
        if not top.is_dir():
            return
        for shard in sorted(top.iterdir()):
            for file in sorted(shard.iterdir()) if shard.is_dir() else ():
                try:
                    stat = file.stat()
                except FileNotFoundError:  # removed meanwhile
                    continue
                if _DIGEST.match("sha256:" + file.name):
                    yield StoredBlob("sha256:" + file.name, stat.st_size, stat.st_mtime)

    def staging_files(self) -> list[Path]:
        """The files in the staging folder: uploads in progress, or ones a crash left behind."""
        return sorted(self._staging.iterdir()) if self._staging.is_dir() else []

    def clear_staging(self) -> None:
        """Remove uploads a crash left half written (called at start-up)."""
        shutil.rmtree(self._staging, ignore_errors=True)
        self._staging.mkdir(parents=True, exist_ok=True)

    def _staging_file(self) -> tuple[BinaryIO, Path]:
        fd, name = tempfile.mkstemp(prefix="upload-", suffix=".part", dir=self._staging)
        return os.fdopen(fd, "wb"), Path(name)

    def _location(self, tenant: str, hex_digest: str) -> Path:
        if not _TENANT.match(tenant):
            raise ValueError(f"invalid tenant id {tenant!r}")
        return self.root / tenant / "sha256" / hex_digest[:2] / hex_digest

    def _name_location(self, tenant: str, hex_digest: str) -> Path:
        return self._location(tenant, hex_digest).parents[2] / "names" / hex_digest

    def _remember_name(self, tenant: str, hex_digest: str, name: str) -> None:
        target = self._name_location(tenant, hex_digest)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, lambda tmp: tmp.write_text(name, "utf-8"))

    def _place(self, tenant: str, staged: Path, info: BlobInfo) -> None:
        """Rename a complete, synced, hashed file to its content address. A blob already there
        is replaced all the same: the new file's bytes were just hashed, the stored one's may
        have been damaged since, so storing the same bytes again always heals it (and makes it
        fresh for the collector's retention)."""
        target = self._location(tenant, info.hex)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, target)
        sync_directory(target.parent)


def _write_hashed(handle: BinaryIO, digest: hashlib._Hash, chunks: list[bytes]) -> None:
    for chunk in chunks:
        digest.update(chunk)
        handle.write(chunk)


def _flush_and_sync(handle: BinaryIO) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _raise_if_disk_full(exc: OSError, what: str, resource: str = "blob store") -> None:
    """Turn a full disk (or file system quota) into the typed 507 error naming the resource;
    other OS errors pass."""
    if exc.errno in _DISK_FULL:
        raise InsufficientStorageError(
            f"the server's disk is full ({resource}: {what} not stored, nothing kept); free space, or shorten "
            "BNRECAL_BLOB_RETENTION_S / BNRECAL_JOB_RETENTION_S and run `bnrecal gc`"
        ) from exc


def _corrupt_message(digest: str, name: str | None, field: str | None, medium: str) -> str:
    shown = f"{name!r} ({digest})" if name else digest
    prefix = f"{field}: " if field else ""
    return (
        f"{prefix}blob {shown} is corrupt: its stored bytes no longer hash to its digest (damaged {medium}); "
        "the server quarantined it: upload the file again (a client that asks HEAD /v1/blobs first now gets 404 "
        "and uploads it)"
    )
