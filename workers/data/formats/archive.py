"""Safe, once-only unpacking of image archives (``.tar``, ``.tar.gz``/``.tgz``, ``.zip``, ...).

Every member is checked before anything of it is written: no absolute path, no ``..``
component, no link or device (only regular files and folders), at most ``max_members``
members and ``max_unpacked_bytes`` bytes in all (declared sizes are checked up front and
the bytes actually written are counted too). Images are already compressed, so an archive
of images barely shrinks: a zip member, or a whole archive as it unpacks, that expands
more than ``max_compression_ratio`` times (past the first MiB) is a decompression bomb and
refused before it fills the disk. Only image files are written. The archive
unpacks into a fresh temporary folder beside the target, which is renamed into place
when complete, so no process ever sees half an unpack and a second call reuses it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bnrecal.workers.data.formats.images import is_ignored_part, is_image_name
from bnrecal.workers.data.opened import FileFormat
from bnrecal.workers.files import file_digest
from bnrecal.errors import DatasetError, DatasetOptionError

DEFAULT_MAX_MEMBERS = 1_000_000
DEFAULT_MAX_UNPACKED_BYTES = 64 * 2**30
DEFAULT_MAX_COMPRESSION_RATIO = 50.0
RATIO_FREE_BYTES = 1 << 20  # below this, any ratio is harmless (tiny files compress well)
_MARKER = ".bnrecal-unpacked.json"  # hidden, so never listed as data
DISCARD_MARKER = ".bnrecal-discard"  # in an unpack: remove me once no job uses me
COLLECTED_ROOT_MARKER = ".bnrecal-collected"  # in an unpack root: a collector owns removals here
_COPY_CHUNK = 1 << 20
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first member, or an empty zip's end record
TAR_MAGICS = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")  # gzip, bzip2, xz: a compressed tar
TAR_NAMES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")


def _is_zip(head: bytes, path: Path) -> bool:
    if not head.startswith(ZIP_MAGICS):
        return False
    try:
        with zipfile.ZipFile(path):
            return True
    except (zipfile.BadZipFile, OSError):
        return False


def _is_tar(head: bytes, path: Path) -> bool:
    """A plain tar (``ustar`` at byte 257), or a file compressed as tars are (its content is
    told when it is read)."""
    return head.startswith(TAR_MAGICS) or head[257:262] == b"ustar"


TAR = FileFormat("tar", TAR_NAMES, "archive", _is_tar)
ZIP = FileFormat("zip", (".zip",), "archive", _is_zip)


@dataclass(frozen=True)
class _Member:
    """One archive entry, reduced to what the safety checks need."""

    name: str
    kind: str  # "file", "dir", or what it is instead ("symbolic link", ...)
    size: int  # declared uncompressed size
    open_data: Callable[[], IO[bytes]]


def default_unpack_root() -> Path:
    """Cache folder for unpacked archives: ``$XDG_CACHE_HOME/bnrecal/unpacked`` or ``~/.cache/...``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bnrecal" / "unpacked"


def unpack_archive(
    archive: Path,
    kind: str,
    unpack_dir: Path | None = None,
    *,
    name: str | None = None,
    unpack_root: Path | None = None,
    max_members: int = DEFAULT_MAX_MEMBERS,
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES,
    max_compression_ratio: float = DEFAULT_MAX_COMPRESSION_RATIO,
) -> Path:
    """Unpack the images of ``archive`` (``kind`` ``"tar"`` or ``"zip"``) and return the folder.

    ``unpack_dir`` defaults to ``<unpack_root>/<sha256 of archive>``, the root being the
    user cache unless given, so different archives never share a folder. A folder already holding a
    complete unpack of the same archive is reused; one holding anything else is refused.
    Any unsafe member refuses the whole archive with a :class:`DatasetError` and leaves
    nothing behind. Errors call the archive ``name`` (the name the user knows, where the
    file's own is internal: an uploaded blob's digest), else the file's own name.
    """
    shown = name or archive.name
    _check_bound(max_members, "max_members")
    _check_bound(max_unpacked_bytes, "max_unpacked_bytes")
    if not max_compression_ratio >= 1:
        raise DatasetOptionError(
            f"max_compression_ratio must be >= 1, got {max_compression_ratio!r}", field="max_compression_ratio"
        )
    limits = _Limits(max_members, max_unpacked_bytes, max_compression_ratio, archive.stat().st_size)
    digest = file_digest(archive).removeprefix("sha256:")  # the cache key of its unpack
    target = Path(unpack_dir) if unpack_dir is not None else Path(unpack_root or default_unpack_root()) / digest
    target = target.expanduser().absolute()
    if _is_unpack_of(target, digest):
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        if _is_unpack_of(target, digest):  # another describe's unpack of it landed (whole: renamed in) just now
            return target
        raise DatasetError(f"unpack folder {target} already holds other files; choose an empty or new one")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=target.parent))
    try:
        members = _tar_members(archive, shown) if kind == "tar" else _zip_members(archive, shown, limits)
        try:
            _extract(members, staging, shown, limits)
        finally:
            members.close()
        (staging / _MARKER).write_text(json.dumps({"archive_sha256": digest, "source": archive.name}))
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_unpack_of(target, digest):  # else another process finished the same unpack first
                raise
    except OSError as exc:
        raise DatasetError(f"cannot unpack {shown}: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass(frozen=True)
class _Limits:
    """The bounds one unpack runs under, and the archive's size the ratio is taken against."""

    members: int
    unpacked_bytes: int
    compression_ratio: float
    archive_bytes: int

    def check_expansion(self, archive_name: str, unpacked: int, packed: int, what: str) -> None:
        """Refuse ``what`` when ``unpacked`` bytes came from ``packed`` at an implausible ratio."""
        if unpacked > RATIO_FREE_BYTES and unpacked > self.compression_ratio * max(packed, 1):
            raise DatasetError(
                f"{archive_name}: {what} expands {unpacked / max(packed, 1):.0f}:1, more than images compress "
                f"(limit {self.compression_ratio:g}:1); refusing the archive as a decompression bomb "
                "(BNRECAL_MAX_COMPRESSION_RATIO)"
            )


def discard_unpack(folder: str | os.PathLike[str]) -> bool:
    """Remove the unpack that ``folder`` lies in (its root holds the unpack marker), e.g.
    once a job failed on its content: a bad archive must not keep its bytes on disk.

    Under an unpack root a collector owns (see :func:`mark_collected_root`: the service's,
    where other jobs may be reading the same unpack right now) the unpack is only marked
    discarded, and the collector removes it as soon as no queued or running job uses it.
    Returns whether anything was removed or marked; a folder that is not an unpack is left alone.
    """
    current = Path(folder).absolute()
    for candidate in (current, *current.parents[:4]):
        if (candidate / _MARKER).is_file():
            if (candidate.parent / COLLECTED_ROOT_MARKER).is_file():
                (candidate / DISCARD_MARKER).touch()
            else:
                shutil.rmtree(candidate, ignore_errors=True)
            return True
    return False


def mark_collected_root(unpack_root: str | os.PathLike[str]) -> None:
    """Declare that a collector which knows every job removes the unpacks under ``unpack_root``,
    so :func:`discard_unpack` only marks an unpack there instead of removing it under a running job."""
    root = Path(unpack_root)
    root.mkdir(parents=True, exist_ok=True)
    (root / COLLECTED_ROOT_MARKER).touch()


def is_discarded_unpack(folder: str | os.PathLike[str]) -> bool:
    """Whether :func:`discard_unpack` marked this unpack folder for removal."""
    return (Path(folder) / DISCARD_MARKER).is_file()


def is_unpack_folder(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a complete unpack (its marker is there)."""
    return (Path(folder) / _MARKER).is_file()


def _check_bound(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DatasetOptionError(f"{name} must be a positive integer, got {value!r}", field=name)


def _is_unpack_of(folder: Path, digest: str) -> bool:
    try:
        return json.loads((folder / _MARKER).read_text()).get("archive_sha256") == digest
    except (OSError, ValueError, AttributeError):
        return False


def _safe_parts(name: str, archive_name: str) -> list[str]:
    """Split a member name into path components, refusing absolute paths and ``..``."""
    drive = len(name) > 2 and name[0].isalpha() and name[1] == ":" and name[2] in "/\\"
    if name.startswith(("/", "\\")) or drive:
        raise DatasetError(f"{archive_name}: member {name!r} has an absolute path; refusing the archive")
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise DatasetError(f"{archive_name}: member {name!r} has a '..' component; refusing the archive")
    if "\0" in name:
        raise DatasetError(f"{archive_name}: member {name!r} has a NUL byte in its name; refusing the archive")
    return parts


def _extract(members: Iterator[_Member], staging: Path, archive_name: str, limits: _Limits) -> None:
    count = 0
    total = 0
    written = [0]  # bytes written so far, for the whole-archive expansion check
    max_bytes = limits.unpacked_bytes
    for member in members:
        count += 1
        if count > limits.members:
            raise DatasetError(
                f"{archive_name} has more than {limits.members} members; refusing the archive "
                "(max_members)"
            )
        parts = _safe_parts(member.name, archive_name)
        if member.kind not in ("file", "dir"):
            raise DatasetError(
                f"{archive_name}: member {member.name!r} is a {member.kind}; only files and folders are allowed"
            )
        total += member.size
        if total > max_bytes:
            raise DatasetError(_too_large(archive_name, max_bytes))
        if member.kind == "dir" or not parts or not is_image_name(parts[-1]):
            continue
        if any(is_ignored_part(p) for p in parts):
            continue
        destination = staging.joinpath(*parts)
        destination.parent.mkdir(parents=True, exist_ok=True)
        _copy_member(member, destination, member.size, archive_name, limits, written)


def _too_large(archive_name: str, max_bytes: int) -> str:
    return (
        f"{archive_name} unpacks to more than {max_bytes} bytes; refusing the archive "
        "(max_unpacked_bytes, BNRECAL_MAX_UNPACKED_BYTES)"
    )


def _copy_member(
    member: _Member, destination: Path, budget: int, archive_name: str, limits: _Limits, written_total: list[int]
) -> None:
    """Write one member, never more than its declared size, never through an existing entry."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(destination, flags, 0o644)
    except FileExistsError as exc:
        raise DatasetError(f"{archive_name}: member {member.name!r} appears twice; refusing the archive") from exc
    written = 0
    try:
        with os.fdopen(fd, "wb") as out, member.open_data() as source:
            while chunk := source.read(_COPY_CHUNK):
                written += len(chunk)
                written_total[0] += len(chunk)
                if written > budget:
                    raise DatasetError(
                        f"{archive_name}: member {member.name!r} holds more data than it declares; refusing the archive"
                    )
                limits.check_expansion(archive_name, written_total[0], limits.archive_bytes, "the archive")
                out.write(chunk)
    except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise DatasetError(f"{archive_name} is corrupt at member {member.name!r}: {exc}") from exc


def _tar_members(archive: Path, shown: str) -> Generator[_Member, None, None]:
    """Stream the members of a tar (any compression tarfile knows) without listing it first;
    errors call it ``shown``."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            for info in tar:
                if info.isfile():
                    kind = "file"
                elif info.isdir():
                    kind = "dir"
                elif info.issym():
                    kind = "symbolic link"
                elif info.islnk():
                    kind = "hard link"
                else:
                    kind = "device or special file"
                yield _Member(info.name, kind, info.size if kind == "file" else 0, _tar_opener(tar, info, shown))
                tar.members.clear()  # keep memory flat on huge archives
    except (tarfile.TarError, zlib.error, EOFError) as exc:
        raise DatasetError(f"{shown} is not a valid tar archive: {exc}") from exc


def _tar_opener(tar: tarfile.TarFile, info: tarfile.TarInfo, shown: str) -> Callable[[], IO[bytes]]:
    def open_data() -> IO[bytes]:
        data = tar.extractfile(info)
        if data is None:
            raise DatasetError(f"{shown}: member {info.name!r} has no data")
        return data

    return open_data


def _zip_members(archive: Path, shown: str, limits: _Limits) -> Generator[_Member, None, None]:
    """The members of a zip, from its central directory; count, declared sizes and each
    member's compression ratio are checked before anything is written; errors call it ``shown``."""
    try:
        with zipfile.ZipFile(archive) as zf:
            infos = zf.infolist()
            if len(infos) > limits.members:
                raise DatasetError(
                    f"{shown} has more than {limits.members} members; refusing the archive "
                    "(max_members)"
                )
            if sum(info.file_size for info in infos) > limits.unpacked_bytes:
                raise DatasetError(_too_large(shown, limits.unpacked_bytes))
            for info in infos:
                limits.check_expansion(shown, info.file_size, info.compress_size, f"member {info.filename!r}")
            for info in infos:
                file_type = stat.S_IFMT(info.external_attr >> 16)  # 0 when the archiver recorded none
                if info.is_dir() or file_type == stat.S_IFDIR:
                    kind = "dir"
                elif file_type == stat.S_IFLNK:
                    kind = "symbolic link"
                elif file_type not in (0, stat.S_IFREG):
                    kind = "device or special file"
                else:
                    kind = "file"
                if kind == "file" and info.flag_bits & 0x1:
                    raise DatasetError(f"{shown}: member {info.filename!r} is encrypted")
                yield _Member(info.filename, kind, info.file_size if kind == "file" else 0, _zip_opener(zf, info))
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise DatasetError(f"{shown} is not a valid zip archive: {exc}") from exc


def _zip_opener(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> Callable[[], IO[bytes]]:
    return lambda: zf.open(info)
