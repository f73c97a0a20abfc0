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

import hashlib
import os
import re
import shutil
import tempfile
import unicodedata
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import anyio

from workers.errors import NotFoundError, PayloadTooLargeError
from workers.files import atomic_write, sync_directory

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
_DIGEST = re.compile(DIGEST_PATTERN)
_TENANT = re.compile(r"^[0-9a-z_-]{1,64}$")
_WRITE_CHUNK = 1024 * 1024  # bytes gathered before one write (and one thread hop)
MAX_FILENAME_CHARS = 255


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

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
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
        self, tenant: str, chunks: AsyncIterator[bytes], max_bytes: int, filename: str | None = None
    ) -> BlobInfo:
        """Store a streamed upload, hashing it as it arrives; memory use does not grow with its size.

        The byte cap is enforced on the bytes actually received: the upload stops with
        ``PayloadTooLargeError`` at the first chunk past ``max_bytes`` and nothing of it
        stays on disk. ``filename`` (cleaned by :func:`clean_filename`) is remembered for
        messages; an upload without one keeps the name the bytes had.
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
                        raise PayloadTooLargeError(
                            f"upload exceeds the limit of {max_bytes} bytes (BNRECAL_MAX_UPLOAD_BYTES)"
                        )
                    pending.append(chunk)
                    pending_bytes += len(chunk)
                    if pending_bytes >= _WRITE_CHUNK:
                        await anyio.to_thread.run_sync(_write_hashed, handle, digest, pending)
                        pending, pending_bytes = [], 0
                await anyio.to_thread.run_sync(_write_hashed, handle, digest, pending)
                await anyio.to_thread.run_sync(_flush_and_sync, handle)
            info = BlobInfo(f"sha256:{digest.hexdigest()}", size)
            await anyio.to_thread.run_sync(self._place, tenant, staged, info)
            name = clean_filename(filename)
            if name is not None:
                await anyio.to_thread.run_sync(self._remember_name, tenant, info.hex, name)
            return BlobInfo(info.digest, size, name or self.filename(tenant, info.digest))
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
        finally:
            staged.unlink(missing_ok=True)

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
