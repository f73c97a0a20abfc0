"""What the two blob store backends (:mod:`.files`, :mod:`.s3`) do the same way, written once.

- The layout of a tenant's blobs, the same on disk and in a bucket: ``<tenant>/sha256/<hex[:2]>/<hex>``,
  with side records at ``<tenant>/<kind>/<hex>`` (``names``; ``used`` in a bucket), and the
  checks of a tenant id and a digest before either becomes a path or a key.
- :class:`Staging`: the local folder where an upload is hashed into a file as it streams in
  (with the byte cap and a full disk turned into typed errors), and where an artifact is
  copied when it cannot be renamed into place; :func:`adopt_file`, the artifact's way in.
- Digest checks: :func:`verified_chunks` (a streamed read that holds
  back its last chunk until the bytes are known to match), and :func:`corrupt_error` (the
  log line, the metric and the ``CorruptBlobError`` of a damaged blob).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import anyio

from bnrecal.workers.files import stream_digest
from bnrecal.errors import BnrecalError, CorruptBlobError, InsufficientStorageError, NotFoundError, PayloadTooLargeError

from bnrecal.service.jobserver.storage.blobs.store import BlobInfo, CorruptHook, WriteChunks, clean_filename, is_digest

log = logging.getLogger("bnrecal.blobs")

WRITE_CHUNK = 1024 * 1024
"""Bytes gathered before one write (and one thread hop), and read at once when hashing."""

_TENANT = re.compile(r"^[0-9a-z_-]{1,64}$")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

Place = Callable[[Path, BlobInfo], None]
"""Moves a complete, hashed local file under its content address (the backend's own step)."""


# -- names: tenants, digests, the layout -------------------------------------------------------


def is_tenant(name: str) -> bool:
    """Whether ``name`` is a well-formed tenant id (what a listing of a store keeps)."""
    return bool(_TENANT.match(name))


def tenant_folder(tenant: str) -> str:
    """The tenant id, checked before it becomes part of a path or key (``ValueError`` if malformed)."""
    if not _TENANT.match(tenant):
        raise ValueError(f"invalid tenant id {tenant!r}")
    return tenant


def checked_hex(digest: str) -> str:
    """The bare hex of a well-formed digest; ``NotFoundError`` saying what a digest looks like otherwise."""
    if not is_digest(digest):
        raise NotFoundError(f"no blob {digest!r}: a digest looks like sha256:<64 hex digits>")
    return digest.removeprefix("sha256:")


def missing(digest: str) -> NotFoundError:
    """The error for a blob the tenant does not hold."""
    return NotFoundError(f"no blob {digest} for this API key")


def blob_key(tenant: str, hex_digest: str) -> str:
    """Where a tenant's blob lives, relative to the store's root or prefix: ``<tenant>/sha256/<hex[:2]>/<hex>``."""
    return f"{tenant_folder(tenant)}/sha256/{hex_digest[:2]}/{hex_digest}"


def side_key(tenant: str, kind: str, hex_digest: str) -> str:
    """Where a record about a tenant's blob lives (``names``: its file name; ``used``: its
    last use), relative to the store's root or prefix: ``<tenant>/<kind>/<hex>``."""
    return f"{tenant_folder(tenant)}/{kind}/{hex_digest}"


def blob_hex(name: str) -> str | None:
    """The hex digest a stored file or object is named by; None for anything else found there."""
    return name if is_digest("sha256:" + name) else None


def named(
    info: BlobInfo, filename: str | None, remember: Callable[[str], None], known: Callable[[], str | None]
) -> BlobInfo:
    """A just-stored upload's info with its file name: the upload's own, cleaned
    (:func:`~.store.clean_filename`) and handed to ``remember`` (the backend keeps it beside
    the blob), or, for an upload without one, the name the same bytes were stored with before
    (``known()``)."""
    name = clean_filename(filename)
    if name is not None:
        remember(name)
    return BlobInfo(info.digest, info.size, name or known())


# -- digests -----------------------------------------------------------------------------------


def verified_chunks(
    handle: BinaryIO, digest: str, corrupt: Callable[[int], CorruptBlobError], chunk_size: int = WRITE_CHUNK
) -> Iterator[bytes]:
    """The bytes of an open blob file in chunks, hashed as they are read; the last chunk is
    held back until the digest is known, and a mismatch raises ``corrupt(the file's inode)``
    instead, so a reader never gets all of a damaged blob."""
    inode = os.fstat(handle.fileno()).st_ino
    hashed = hashlib.sha256()
    held: bytes | None = None
    while block := handle.read(chunk_size):
        hashed.update(block)
        if held is not None:
            yield held
        held = block
    if "sha256:" + hashed.hexdigest() != digest:
        raise corrupt(inode)
    if held is not None:
        yield held


def corrupt_error(
    tenant: str, digest: str, where: str, field: str | None, name: str | None, medium: str, on_corrupt: CorruptHook | None
) -> CorruptBlobError:
    """A blob's stored bytes do not hash to its digest (already quarantined by the caller): log
    it, tell ``on_corrupt`` (the metrics) and return the error to raise, which names the blob,
    where it was damaged (``medium``) and says to upload it again."""
    log.error("blob %s of %s (%s) is corrupt (found by %s): quarantined", digest, tenant, name or "no name", where)
    if on_corrupt is not None:
        on_corrupt(where)
    shown = f"{name!r} ({digest})" if name else digest
    prefix = f"{field}: " if field else ""
    message = (
        f"{prefix}blob {shown} is corrupt: its stored bytes no longer hash to its digest (damaged {medium}); "
        "the server quarantined it: upload the file again (a client that asks HEAD /v1/blobs first now gets 404 "
        "and uploads it)"
    )
    return CorruptBlobError(message, field, digest)


# -- staging and placing -----------------------------------------------------------------------


def raise_if_disk_full(exc: OSError, what: str, resource: str = "blob store") -> None:
    """Turn a full disk (or file system quota) into the typed 507 error naming the resource;
    other OS errors pass."""
    if exc.errno in _DISK_FULL:
        raise InsufficientStorageError(
            f"the server's disk is full ({resource}: {what} not stored, nothing kept); free space, or shorten "
            "BNRECAL_BLOB_RETENTION_S / BNRECAL_JOB_RETENTION_S and run `bnrecal gc`"
        ) from exc


class Staging:
    """A store's local staging folder (``<root>/.staging``): every upload is hashed into a file
    here as it streams in and only then placed, so a blob is complete or absent; what a crash
    leaves here is cleared at start-up, or by the collector once stale."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)

    def new_file(self, prefix: str = "upload-") -> tuple[BinaryIO, Path]:
        """A fresh file in the folder, open for writing, and its path."""
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".part", dir=self.folder)
        return os.fdopen(fd, "wb"), Path(name)

    def files(self) -> list[Path]:
        """The files in the folder: uploads in progress, or ones a crash left behind."""
        return sorted(self.folder.iterdir()) if self.folder.is_dir() else []

    def clear(self) -> None:
        """Remove everything in the folder (half-written uploads of a crash)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True, exist_ok=True)

    async def receive(
        self,
        chunks: AsyncIterator[bytes],
        max_bytes: int,
        over_limit: Callable[[int], BnrecalError] | None,
        write_chunks: WriteChunks,
        keep: Callable[[Path, BlobInfo], BlobInfo],
    ) -> BlobInfo:
        """Hash a streamed upload into a staging file, then ``keep(file, info)`` it (in a
        thread): what ``keep`` returns. Memory use does not grow with the upload's size.

        The byte cap is enforced on the bytes actually received: the upload stops with
        ``PayloadTooLargeError`` (or ``over_limit(bytes received)``, e.g. a quota's error) at
        the first chunk past ``max_bytes``. A disk that fills up (here or in ``keep``) is an
        ``InsufficientStorageError``. Either way the staging file is gone afterwards."""
        digest = hashlib.sha256()
        size = 0
        handle, staged = self.new_file()
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
                    if pending_bytes >= WRITE_CHUNK:
                        await anyio.to_thread.run_sync(write_chunks, handle, digest, pending)
                        pending, pending_bytes = [], 0
                await anyio.to_thread.run_sync(write_chunks, handle, digest, pending)
                await anyio.to_thread.run_sync(_flush_and_sync, handle)
            return await anyio.to_thread.run_sync(keep, staged, BlobInfo(f"sha256:{digest.hexdigest()}", size))
        except OSError as exc:
            raise_if_disk_full(exc, f"upload of {size} bytes")
            raise
        finally:
            staged.unlink(missing_ok=True)

    def copy_in(self, file: Path, place: Place) -> BlobInfo:
        """Copy a file into a staging file, hashed as it is written, and ``place`` that: for a
        file that cannot simply be renamed into the store (another file system)."""
        digest = hashlib.sha256()
        handle, staged = self.new_file()
        try:
            with handle, open(file, "rb") as source:
                size = 0
                while block := source.read(WRITE_CHUNK):
                    digest.update(block)
                    handle.write(block)
                    size += len(block)
                _flush_and_sync(handle)
            info = BlobInfo(f"sha256:{digest.hexdigest()}", size)
            place(staged, info)
            return info
        finally:
            staged.unlink(missing_ok=True)


def adopt_file(file: Path, staging: Staging, place: Place) -> BlobInfo:
    """Take a finished file (a job artifact) into a store: hashed where it lies, synced, and
    handed to ``place`` as it is (docs/storage.md, "A full disk": storing an artifact needs no
    room beside it). Only a file ``place`` cannot rename (another file system) is copied
    through ``staging`` first. A full disk is an ``InsufficientStorageError``."""
    try:
        with open(file, "r+b") as handle:
            os.fsync(handle.fileno())  # durable before its name says it is complete
            info = BlobInfo(stream_digest(handle), os.fstat(handle.fileno()).st_size)
        try:
            place(file, info)
            return info
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
        return staging.copy_in(file, place)
    except OSError as exc:
        raise_if_disk_full(exc, f"storing {file.name}", resource="blob store")
        raise


def write_hashed(handle: BinaryIO, digest: hashlib._Hash, chunks: list[bytes]) -> None:
    """The default :data:`~.store.WriteChunks`: hash each chunk and write it to the staged file."""
    for chunk in chunks:
        digest.update(chunk)
        handle.write(chunk)


def _flush_and_sync(handle: BinaryIO) -> None:
    handle.flush()
    os.fsync(handle.fileno())
