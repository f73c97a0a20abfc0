"""A rank's own check of a content-addressed input before it reads it.

The server stores every upload under its digest (``<root>/<tenant>/sha256/<hex[:2]>/<hex>``,
docs/storage.md, "Stored bytes are verified"), so a file at such a path says what its bytes
must hash to. A rank hashes such a file before it reads the first sample (once per process:
a warm rank that reads the same unchanged file again does not hash it again) and refuses
one that does not match with a ``CorruptBlobError`` naming the blob, instead of computing
statistics from damaged samples. Files anywhere else (a user's own path) are read as they are.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from bnrecal.errors import CorruptBlobError
from bnrecal.workers.files import stream_digest

_BLOB_PATH = re.compile(r"(?:^|/)sha256/([0-9a-f]{2})/(\1[0-9a-f]{62})$")
_verified: set[tuple[str, int, int, int]] = set()  # (path, inode, size, mtime_ns) hashed and found intact
_lock = threading.Lock()


def content_address(path: str | os.PathLike[str]) -> str | None:
    """The digest a file's path names (``sha256:<hex>``) when it lies in a blob store, else None."""
    match = _BLOB_PATH.search(Path(path).as_posix())
    return f"sha256:{match.group(2)}" if match else None


def verify_content_address(path: str | os.PathLike[str], field: str = "data") -> None:
    """Hash a file stored under its digest before it is read; ``CorruptBlobError`` if its bytes
    no longer match (nothing for a file that is not in a blob store)."""
    digest = content_address(path)
    if digest is None:
        return
    with open(path, "rb") as handle:
        stat = os.fstat(handle.fileno())
        key = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with _lock:
            if key in _verified:
                return
        actual = stream_digest(handle)
    if actual != digest:
        raise CorruptBlobError(
            f"{field}: blob {digest} is corrupt: its stored bytes no longer hash to its digest (damaged on the "
            "server's disk); upload the file again",
            field, digest,
        )
    with _lock:
        _verified.add(key)
