"""A full disk, told apart from other failures and answered as 507 naming what did not fit
(docs/storage.md, "A full disk"), and the free-space reserve under which new jobs are refused.

Every writer of the data dir meets a full disk its own way: an ``OSError`` with ``ENOSPC``
(blob uploads), SQLite's "database or disk is full" (the ledger), Postgres's ``DiskFull``,
torch's ``inline_container.cc`` "file write failed" (a job saving its checkpoint). This
module turns each into one :class:`InsufficientStorageError` that names the resource (the
job ledger, the blob store, a job's work dir) and what to do.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from bnrecal.errors import InsufficientStorageError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXTS = ("no space left on device", "database or disk is full", "disk quota exceeded",
                    "could not extend file", "diskfull")
_WRITE_TEXTS = ("write", "flush", "inline_container", "iostream error")  # torch: "file write failed", "unexpected pos"
LOW_SPACE_BYTES = 16 * 2**20
"""Below this many free bytes, a job's failure to write is taken for a full disk even when the
writer's message does not say so (torch's "file write failed")."""

FREE_SPACE_HINT = (
    "free space on the server, or shorten BNRECAL_BLOB_RETENTION_S / BNRECAL_JOB_RETENTION_S and run `bnrecal gc`"
)


def free_bytes(path: Path) -> int:
    """Free bytes (for an unprivileged writer) on the file system of ``path`` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the disk or a quota is full."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return True
        text = f"{type(current).__name__} {current}".lower()
        if any(marker in text for marker in _DISK_FULL_TEXTS):
            return True
        current = current.__cause__ or current.__context__
    return False


def disk_full_error(exc: BaseException, resource: str, path: Path, what: str) -> InsufficientStorageError | None:
    """The 507 for ``exc`` when it was a full disk under ``path`` (``resource`` names what
    could not be written, ``what`` what was lost); None when it was something else. A failed
    write on a disk with under ``LOW_SPACE_BYTES`` free counts as a full disk too."""
    try:
        free = free_bytes(path)
    except OSError:
        free = None
    full = is_disk_full(exc) or (free is not None and free < LOW_SPACE_BYTES and _says_write_failed(exc))
    if not full:
        return None
    left = f", {free} bytes free" if free is not None else ""
    return InsufficientStorageError(
        f"the server's disk is full ({resource}{left}): {what}; nothing partial was kept; {FREE_SPACE_HINT}"
    )


def _says_write_failed(exc: BaseException) -> bool:
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            return False
        if any(text in str(current).lower() for text in _WRITE_TEXTS):
            return True
        current = current.__cause__ or current.__context__
    return False


def check_reserve(data_dir: Path, reserve: int) -> None:
    """Refuse new work (507) while the data dir's file system has less than ``reserve`` bytes
    free (``BNRECAL_MIN_FREE_BYTES``), so a job never fills the disk the ledger and blobs live on."""
    if reserve <= 0:
        return
    free = free_bytes(data_dir)
    if free < reserve:
        raise InsufficientStorageError(
            f"the server's disk is nearly full (data dir: {free} bytes free, under the reserve of {reserve} bytes, "
            f"BNRECAL_MIN_FREE_BYTES): new jobs are refused until there is room; {FREE_SPACE_HINT}"
        )
