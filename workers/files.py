"""Durable file writes and file digests, shared by checkpoints, reports, the blob store and
the client."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

T = TypeVar("T")


def sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: some file systems refuse it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(target: Path, write: Callable[[Path], T]) -> T:
    """Write ``target`` so readers see the old file or the whole new one, never a part.

    ``write`` fills a temporary file beside the target (given the usual file mode, not
    mkstemp's 0600), which is fsynced and renamed into place; what it returns (what it
    found checking the file, say) is returned once the file is in place.
    """
    directory = target.parent if str(target.parent) else Path(".")
    handle, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    os.close(handle)
    tmp = Path(tmp_name)
    try:
        os.chmod(tmp, 0o666 & ~_current_umask())
        made = write(tmp)
        with tmp.open("rb+") as written:
            os.fsync(written.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_directory(directory)
    return made


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def stream_digest(handle: BinaryIO) -> str:
    """The ``sha256:<hex>`` digest of an open file's bytes from where it stands, read in
    blocks: the name a blob of those bytes has (docs/storage.md)."""
    return "sha256:" + hashlib.file_digest(handle, "sha256").hexdigest()


def file_digest(path: str | os.PathLike[str]) -> str:
    """The ``sha256:<hex>`` digest of the file at ``path`` (``stream_digest``)."""
    with open(path, "rb") as handle:
        return stream_digest(handle)
