"""The blob store's interface, :class:`BlobStore`, and the values that cross it.

The job server, the HTTP routes, the storage collector, the scrub and ``bnrecal gc`` use a
blob store only through :class:`BlobStore`: the operations listed there are all they call.
Two implementations sit side by side and neither builds on the other: local files
(:class:`~.files.FileBlobStore`, the default) and S3-compatible object storage
(:class:`~.s3.S3BlobStore`, for a replicated service); :func:`~.opening.open_blob_store`
picks one from the settings. What both do the same way is written once in :mod:`.shared`.

This module also holds what a blob is called and shown as, for callers that only need that
(the job spec's digest pattern, the HTTP client's file-name limit): it imports nothing but
the standard library and the error tree, so the client loads no backend.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from bnrecal.errors import BnrecalError, CorruptBlobError

from bnrecal.service.jobserver.digests import DIGEST_PATTERN

MAX_FILENAME_CHARS = 255
"""The longest file name a store keeps for a blob (longer ones are cut)."""

_DIGEST = re.compile(DIGEST_PATTERN)

WriteChunks = Callable[[BinaryIO, "hashlib._Hash", list[bytes]], None]
"""The write layer of uploads: hash and write chunks to the staged file (replaceable in tests)."""

CorruptHook = Callable[[str], None]
"""Told where a corrupt blob was found (``download``, ``job``, ``scrub``, ``submission``): the metrics."""


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


class BlobStore(Protocol):
    """Content-addressed blobs, one namespace per tenant: what the rest of the server needs of
    a blob store, and all it may rely on (:class:`~.files.FileBlobStore` and
    :class:`~.s3.S3BlobStore` both provide it).

    A blob's name is the digest of its bytes; an upload is stored complete or not at all, and
    bytes read for use are checked against their digest (docs/storage.md, "Stored bytes are
    verified"): a mismatch quarantines the blob (``exists`` false, ``HEAD`` 404) and raises
    ``CorruptBlobError``."""

    on_corrupt: CorruptHook | None
    """Told whenever a corrupt blob is found (the server's metrics); None: nobody is told."""

    write_chunks: WriteChunks
    """How an upload's chunks are hashed and written to its staging file (tests replace it to
    fill the disk)."""

    def path(self, tenant: str, digest: str) -> Path:
        """A local file with the blob's bytes, for reading and serving; ``NotFoundError`` if the
        tenant has no such blob."""
        ...

    def filename(self, tenant: str, digest: str) -> str | None:
        """The file name the tenant's blob was last uploaded with; None if it came without one."""
        ...

    def exists(self, tenant: str, digest: str) -> bool:
        """Whether the tenant holds this blob (a malformed digest: False)."""
        ...

    def check(self, tenant: str, digest: str, field: str | None = None, where: str = "job") -> Path:
        """The blob's local file once its bytes are hashed and match its digest: what a job
        reads. A mismatch quarantines it and raises ``CorruptBlobError`` naming it (and the
        spec ``field`` that names it)."""
        ...

    def corrupt(
        self, tenant: str, digest: str, where: str, field: str | None = None, inode: int | None = None
    ) -> CorruptBlobError:
        """Bytes read from the blob's file (``inode``, when known) did not hash to its digest:
        deal with the damage and return the error for the reader to raise."""
        ...

    def scrub(self, tenant: str, digest: str) -> int:
        """Check one stored blob for the periodic scrub: the bytes read; a mismatch quarantines
        it and raises ``CorruptBlobError``."""
        ...

    async def ingest(
        self,
        tenant: str,
        chunks: AsyncIterator[bytes],
        max_bytes: int,
        filename: str | None = None,
        over_limit: Callable[[int], BnrecalError] | None = None,
    ) -> BlobInfo:
        """Store a streamed upload, hashed as it arrives, in memory that does not grow with its
        size; past ``max_bytes`` it stops with ``PayloadTooLargeError`` (or ``over_limit(bytes
        received)``) and nothing of it is kept. ``filename`` is remembered for messages."""
        ...

    def adopt(self, tenant: str, file: Path) -> BlobInfo:
        """Take a finished local file (a job artifact) into the store as one of the tenant's blobs."""
        ...

    def last_used(self, tenant: str, digest: str) -> float:
        """When the blob was stored or last used (epoch seconds); ``NotFoundError`` if absent."""
        ...

    def touch(self, tenant: str, digest: str) -> None:
        """Mark a blob as just used, so the collector keeps it a full retention period."""
        ...

    def remove(self, tenant: str, digest: str) -> int:
        """Delete a tenant's blob and its remembered name; the bytes freed (0 if it was absent)."""
        ...

    def tenants(self) -> list[str]:
        """The tenants that hold blobs, sorted."""
        ...

    def stored(self, tenant: str) -> Iterator[StoredBlob]:
        """Every blob of a tenant, in digest order."""
        ...

    def staging_files(self) -> list[Path]:
        """The files of the local staging folder: uploads in progress, or ones a crash left behind."""
        ...

    def clear_staging(self) -> None:
        """Remove what a crash left half written in the staging folder (called at start-up)."""
        ...
