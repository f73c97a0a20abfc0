"""The content-addressed blob store: uploads, checkpoints, data and job artifacts, per tenant.

A blob lives at ``<root>/<tenant>/sha256/<hex[:2]>/<hex>``; its name is the SHA-256 of
its bytes, so the same bytes always get the same digest and a file is never rewritten.
Every write goes through a temporary file that is hashed while written, fsynced and
renamed into place, so a blob is either complete or absent, never half there.

An upload may come with a file name, kept beside the blob in
``<root>/<tenant>/names/<hex>`` (the name of the latest upload of those bytes that gave
one). It is only ever shown, in messages about the blob; it never becomes a path. A
store written before names existed simply has none.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import tempfile
import unicodedata
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import anyio

from bnrecal.errors import BnrecalError, InsufficientStorageError, NotFoundError, PayloadTooLargeError
from bnrecal.workers.files import atomic_write, sync_directory

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
_DIGEST = re.compile(DIGEST_PATTERN)
_TENANT = re.compile(r"^[0-9a-z_-]{1,64}$")
_WRITE_CHUNK = 1024 * 1024  # bytes gathered before one write (and one thread hop)
MAX_FILENAME_CHARS = 255
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

WriteChunks = Callable[[BinaryIO, "hashlib._Hash", list[bytes]], None]
"""The write layer of uploads: hash and write chunks to the staged file (replaceable in tests)."""


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

    def __init__(self, root: Path, write_chunks: WriteChunks | None = None) -> None:
        self.root = Path(root)
        self.write_chunks: WriteChunks = write_chunks or _write_hashed
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
        """Move a finished file (a job artifact) into the store as one of the tenant's blobs."""
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
        except OSError as exc:
            _raise_if_disk_full(exc, f"storing {file.name}")
            raise
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

    def stored(self, tenant: str) -> Iterator[tuple[str, os.stat_result]]:
        """Every blob of a tenant: its digest and its file's stat (size, mtime)."""
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
                    yield "sha256:" + file.name, stat

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
        """Rename a complete, synced staging file to its content address (a no-op if present)."""
        target = self._location(tenant, info.hex)
        if target.is_file():
            os.utime(target)  # stored again: fresh for the collector's retention
            return
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


def _raise_if_disk_full(exc: OSError, what: str) -> None:
    """Turn a full disk (or file system quota) into the typed 507 error; other OS errors pass."""
    if exc.errno in _DISK_FULL:
        raise InsufficientStorageError(
            f"the server's disk is full ({what} not stored, nothing kept); free space, or shorten "
            "BNRECAL_BLOB_RETENTION_S / BNRECAL_JOB_RETENTION_S and run `bnrecal gc`"
        ) from exc
