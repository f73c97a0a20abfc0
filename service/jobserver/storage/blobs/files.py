"""The blob store on the local file system, :class:`FileBlobStore`: the default backend,
for a server with one data directory. It implements :class:`~.store.BlobStore`; the S3
backend (:mod:`.s3`) sits beside it and shares only :mod:`.shared`'s helpers.

A blob lives at ``<root>/<tenant>/sha256/<hex[:2]>/<hex>``; its name is the SHA-256 of
its bytes, so the same bytes always get the same digest and a file is never rewritten.
Every write goes through a temporary file that is hashed while written, fsynced and
renamed into place, so a blob is either complete or absent, never half there.

Stored bytes are checked against their digest whenever they are read for use
(:meth:`FileBlobStore.check`, :meth:`FileBlobStore.verified_chunks`; docs/api.md, "Blobs"): a blob
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

import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import BinaryIO

from bnrecal.errors import BnrecalError, CorruptBlobError
from bnrecal.workers.files import atomic_write, file_digest, sync_directory

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
    verified_chunks,
    write_hashed,
)
from bnrecal.service.jobserver.storage.blobs.store import BlobInfo, CorruptHook, StoredBlob, WriteChunks, clean_filename, is_digest

QUARANTINE = ".quarantine"
"""The folder under the store's root where corrupt blobs are moved aside (kept for inspection)."""


class FileBlobStore:
    """Blobs on the local file system under ``root``, one namespace per tenant (a :class:`~.store.BlobStore`)."""

    medium = "on the server's disk"
    """Where a damaged blob was damaged, for its error message."""

    def __init__(self, root: Path, write_chunks: WriteChunks | None = None) -> None:
        self.root = Path(root)
        self.write_chunks: WriteChunks = write_chunks or write_hashed
        self.on_corrupt: CorruptHook | None = None
        self._staging = Staging(self.root / ".staging")

    def path(self, tenant: str, digest: str) -> Path:
        """The file of a tenant's blob; ``NotFoundError`` if the tenant has no such blob."""
        file = self._location(tenant, checked_hex(digest))
        if not file.is_file():
            raise missing(digest)
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
            raise missing(digest) from None
        if not good:
            raise self.corrupt(tenant, digest, where, field, inode)
        return file

    def verified_chunks(self, tenant: str, digest: str, handle: BinaryIO, chunk_size: int = WRITE_CHUNK) -> Iterator[bytes]:
        """The bytes of an open blob file in chunks, hashed as they are read; the last chunk is
        held back until the digest is known, and a mismatch raises ``CorruptBlobError`` (the
        blob quarantined) instead, so a reader never gets all of a damaged blob."""

        def damaged(inode: int) -> CorruptBlobError:
            return self.corrupt(tenant, digest, "download", inode=inode)

        return verified_chunks(handle, digest, damaged, chunk_size)

    def corrupt(
        self, tenant: str, digest: str, where: str, field: str | None = None, inode: int | None = None
    ) -> CorruptBlobError:
        """Bytes read from a blob did not hash to its digest: quarantine it (``HEAD`` then 404,
        so clients upload it again), count it, and return the error to raise. ``inode`` is the
        file the bad bytes came from: a file replaced since (healed by an upload) stays."""
        name = self.filename(tenant, digest)
        self._quarantine(tenant, digest, inode)
        return corrupt_error(tenant, digest, where, field, name, self.medium, self.on_corrupt)

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

    # -- writing and deleting ------------------------------------------------------------

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
        (cleaned by :func:`~.store.clean_filename`) is remembered for messages; an upload
        without one keeps the name the bytes had.
        """

        def keep(staged: Path, info: BlobInfo) -> BlobInfo:
            self._place(tenant, staged, info)
            return named(info, filename, partial(self._remember_name, tenant, info.hex), partial(self.filename, tenant, info.digest))

        return await self._staging.receive(chunks, max_bytes, over_limit, self.write_chunks, keep)

    def adopt(self, tenant: str, file: Path) -> BlobInfo:
        """Move a finished file (a job artifact) into the store as one of the tenant's blobs.

        The file is hashed where it lies and renamed into place (docs/storage.md, "A full
        disk"): storing an artifact needs no room beside it. Only a file on another file
        system is copied (through a staging file, hashed as written)."""
        return adopt_file(file, self._staging, partial(self._place, tenant))

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

    # -- listing and staging -------------------------------------------------------------

    def tenants(self) -> list[str]:
        """The tenants that have a folder in the store."""
        if not self.root.is_dir():
            return []
        return sorted(entry.name for entry in self.root.iterdir() if entry.is_dir() and is_tenant(entry.name))

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
                if blob_hex(file.name) is not None:
                    yield StoredBlob("sha256:" + file.name, stat.st_size, stat.st_mtime)

    def staging_files(self) -> list[Path]:
        """The files in the staging folder: uploads in progress, or ones a crash left behind."""
        return self._staging.files()

    def clear_staging(self) -> None:
        """Remove uploads a crash left half written (called at start-up)."""
        self._staging.clear()

    def _location(self, tenant: str, hex_digest: str) -> Path:
        return self.root / blob_key(tenant, hex_digest)

    def _name_location(self, tenant: str, hex_digest: str) -> Path:
        return self.root / side_key(tenant, "names", hex_digest)

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
