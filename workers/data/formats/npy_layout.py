"""Where an array file's rows lie, read from its header alone: an ``.npy`` header, an ``.npz``'s
zip directory and its member's local header (:class:`ArrayLayout`), from a local file or an
object in S3; and the bounds a compressed member is held to.

A compressed member is held to the bounds of an archive (``max_unpacked_bytes``,
``max_compression_ratio``): it may decompress to gigabytes from a few kilobytes, and every
rank would decompress it, so one that expands more than the ratio (past its first MiB) or
to more than the byte bound is refused as a decompression bomb before anything reads it.
"""

from __future__ import annotations

import ast
import io
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np

from bnrecal.workers.data.formats.archive import DEFAULT_MAX_COMPRESSION_RATIO, DEFAULT_MAX_UNPACKED_BYTES, RATIO_FREE_BYTES
from bnrecal.workers.data.storage.files import Place
from bnrecal.workers.data.storage.objectstore import RemoteSource, remote_error
from bnrecal.errors import DatasetError

ArrayStorage = Literal["npy", "npz-stored", "npz-compressed"]

NPY_MAGIC = b"\x93NUMPY"
_MAX_HEADER_BYTES = 10_000  # numpy's own safety bound on the header dictionary
_HEADER_BYTES = 16_384  # an object's first bytes fetched for its npy header (at most 10_012 bytes)
_DIRECTORY_BLOCK = 1 << 16  # readahead while reading an object's zip directory and local header
_ACCEPTED_KINDS = {"f": "float", "u": "unsigned integer", "i": "integer"}
_ZIP_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes, APPNOTE 4.3.7
_PREFERRED_ARRAYS = ("x", "data")
_SKIP_CHUNK = 1 << 18  # bytes decompressed and dropped per read when skipping to a row


@dataclass(frozen=True)
class ArrayLayout:
    """Where the samples lie: storage kind, npz member, dtype, shape and data offset.

    ``data_offset`` is a file offset for ``npy`` and ``npz-stored``, and an offset inside
    the decompressed member for ``npz-compressed``.
    """

    storage: ArrayStorage
    dtype: str
    shape: tuple[int, ...]
    fortran_order: bool
    data_offset: int
    member: str | None = None

    @property
    def array_name(self) -> str | None:
        """The npz array name (the member name without ``.npy``), or None for a ``.npy`` file."""
        return None if self.member is None else self.member.removesuffix(".npy")

    @property
    def nbytes(self) -> int:
        """Size of the array data in bytes."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def read_npy_header(stream: IO[bytes], name: str) -> tuple[np.dtype[Any], tuple[int, ...], bool, int]:
    """Parse an npy header at the stream's position: (dtype, shape, fortran_order, header length).

    Validates without loading data and without unpickling: the array must be float or
    integer, at least 2-D (samples first) and have samples of at least one value.
    """
    magic = stream.read(8)
    if len(magic) < 8 or magic[:6] != NPY_MAGIC:
        raise DatasetError(f"{name} is not a valid .npy array (bad magic bytes)")
    major = magic[6]
    if major == 1:
        (length,) = struct.unpack("<H", read_exact(stream, 2, name))
        prefix, encoding = 10, "latin1"
    elif major in (2, 3):
        (length,) = struct.unpack("<I", read_exact(stream, 4, name))
        prefix, encoding = 12, "utf8" if major == 3 else "latin1"
    else:
        raise DatasetError(f"{name} has an unsupported .npy format version {major}")
    if length > _MAX_HEADER_BYTES:
        raise DatasetError(f"{name} has an oversized .npy header ({length} bytes)")
    try:
        header = ast.literal_eval(read_exact(stream, length, name).decode(encoding))
        dtype = np.lib.format.descr_to_dtype(header["descr"])
        shape = tuple(header["shape"])
        fortran_order = bool(header["fortran_order"])
    except (SyntaxError, ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{name} has a corrupt .npy header") from exc
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise DatasetError(f"{name} has a corrupt .npy header (shape {shape!r})")
    if dtype.kind not in _ACCEPTED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise DatasetError(f"{name} has dtype {dtype} (expected a float, uint8 or other integer array)")
    if len(shape) < 2:
        raise DatasetError(f"{name} has shape {shape} (expected (N, ...) with at least 2 dimensions)")
    if int(np.prod(shape[1:], dtype=np.int64)) == 0:
        raise DatasetError(f"{name} has shape {shape}: each sample holds no values")
    return dtype, shape, fortran_order, prefix + length


def describe_npy(path: Path, name: str | None = None) -> ArrayLayout:
    """The layout of a ``.npy`` file, checked against the file size (truncation is corruption).
    Errors call the file ``name`` (the name the user knows), else the file's own name."""
    with open(path, "rb") as stream:
        return describe_npy_stream(stream, name or path.name, path.stat().st_size)


def describe_npy_stream(stream: IO[bytes], name: str, size: int) -> ArrayLayout:
    """:func:`describe_npy` on an open stream of ``size`` bytes (a local file or a remote object)."""
    dtype, shape, fortran, header_len = read_npy_header(stream, name)
    layout = ArrayLayout("npy", dtype.str, shape, fortran, header_len)
    if header_len + layout.nbytes > size:
        raise DatasetError(f"{name} is truncated: shape {shape} needs {layout.nbytes} data bytes")
    return layout


def describe_npz(
    path: Path,
    *,
    name: str | None = None,
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES,
    max_compression_ratio: float = DEFAULT_MAX_COMPRESSION_RATIO,
) -> ArrayLayout:
    """The layout of the chosen array of an ``.npz``: ``x``, else ``data``, else the only array
    (a compressed one within the bounds, see :func:`check_compressed_member`). Errors call
    the file ``name`` (the name the user knows), else the file's own name."""
    with open(path, "rb") as stream:
        return describe_npz_stream(
            stream, name or path.name, path.stat().st_size,
            max_unpacked_bytes=max_unpacked_bytes, max_compression_ratio=max_compression_ratio,
        )


def describe_npz_stream(
    stream: IO[bytes],
    name: str,
    size: int,
    *,
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES,
    max_compression_ratio: float = DEFAULT_MAX_COMPRESSION_RATIO,
) -> ArrayLayout:
    """:func:`describe_npz` on an open seekable stream of ``size`` bytes (a local file or a
    remote object: only the zip directory and the chosen member's headers are read)."""
    path = Path(name)
    try:
        with zipfile.ZipFile(stream) as archive:
            members = {info.filename: info for info in archive.infolist() if info.filename.endswith(".npy")}
            info = members[_choose_member(path, sorted(members))]
            if info.flag_bits & 0x1:
                raise DatasetError(f"{path.name}: array {info.filename} is encrypted")
            if info.compress_type == zipfile.ZIP_STORED:
                return _describe_stored_member(stream, path, info, size)
            check_compressed_member(path.name, info, size, max_unpacked_bytes, max_compression_ratio)
            with archive.open(info) as member:
                dtype, shape, fortran, header_len = read_npy_header(member, f"{path.name}:{info.filename}")
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        raise DatasetError(f"{path.name} is not a valid .npz file: {exc}") from exc
    layout = ArrayLayout("npz-compressed", dtype.str, shape, fortran, header_len, info.filename)
    if fortran:
        raise DatasetError(
            f"{path.name}: compressed array {layout.array_name} is Fortran-ordered and cannot be read by rows; "
            "save it with np.ascontiguousarray or np.savez (uncompressed)"
        )
    if header_len + layout.nbytes != info.file_size:
        raise DatasetError(f"{path.name}: array {layout.array_name} is corrupt (size does not match its shape)")
    return layout


def check_compressed_member(
    name: str, info: zipfile.ZipInfo, size: int, max_unpacked_bytes: int, max_compression_ratio: float
) -> None:
    """Refuse a compressed ``.npz`` member that decompresses to more than ``max_unpacked_bytes``,
    or more than ``max_compression_ratio`` times its compressed bytes (past the first MiB): the
    limits an archive unpacks under (``BNRECAL_MAX_UNPACKED_BYTES``, ``BNRECAL_MAX_COMPRESSION_RATIO``).

    The sizes are the zip directory's; reading never yields more than the declared size, and
    the compressed size counts at most the whole file's ``size``.
    """
    array = info.filename.removesuffix(".npy")
    if info.file_size > max_unpacked_bytes:
        raise DatasetError(
            f"{name}: compressed array {array} decompresses to {info.file_size} bytes, more than the "
            f"{max_unpacked_bytes} allowed (BNRECAL_MAX_UNPACKED_BYTES); refusing it"
        )
    packed = max(1, min(info.compress_size, size))
    if info.file_size > RATIO_FREE_BYTES and info.file_size > max_compression_ratio * packed:
        raise DatasetError(
            f"{name}: compressed array {array} expands {info.file_size / packed:.0f}:1 ({packed} bytes to "
            f"{info.file_size}), more than calibration data compresses (limit {max_compression_ratio:g}:1); "
            "refusing it as a decompression bomb (BNRECAL_MAX_COMPRESSION_RATIO); "
            "save real data with np.savez (uncompressed)"
        )


def _choose_member(path: Path, members: list[str]) -> str:
    names = [m.removesuffix(".npy") for m in members]
    for preferred in _PREFERRED_ARRAYS:
        if preferred in names:
            return preferred + ".npy"
    if len(names) == 1:
        return members[0]
    if not names:
        raise DatasetError(f"{path.name} holds no arrays")
    raise DatasetError(
        f"{path.name} holds several arrays ({', '.join(names)}) and none is named 'x' or 'data'; "
        "rename the calibration array to 'x'"
    )


def _describe_stored_member(stream: IO[bytes], path: Path, info: zipfile.ZipInfo, size: int) -> ArrayLayout:
    """Find the absolute file offset of an uncompressed member's array data (from its zip
    local header), for a memory map or a ranged read."""
    name = f"{path.name}:{info.filename}"
    stream.seek(info.header_offset)
    raw = stream.read(_ZIP_LOCAL_HEADER.size)
    if len(raw) < _ZIP_LOCAL_HEADER.size:
        raise DatasetError(f"{name}: truncated zip entry")
    fields = _ZIP_LOCAL_HEADER.unpack(raw)
    if fields[0] != b"PK\x03\x04":
        raise DatasetError(f"{name}: corrupt zip entry (bad local header)")
    data_start = info.header_offset + _ZIP_LOCAL_HEADER.size + fields[9] + fields[10]
    stream.seek(data_start)
    dtype, shape, fortran, header_len = read_npy_header(stream, name)
    layout = ArrayLayout("npz-stored", dtype.str, shape, fortran, data_start + header_len, info.filename)
    if header_len + layout.nbytes != info.file_size or layout.data_offset + layout.nbytes > size:
        raise DatasetError(f"{path.name}: array {layout.array_name} is corrupt (size does not match its shape)")
    return layout


def read_exact(stream: IO[bytes], size: int, name: str) -> bytes:
    """Exactly ``size`` bytes of ``stream``; fewer (a cut file) is an error naming ``name``."""
    chunks: list[bytes] = []
    left = size
    while left > 0:
        chunk = stream.read(left)
        if not chunk:
            raise DatasetError(f"{name} is truncated")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def skip_to(stream: IO[bytes], position: int, name: str) -> None:
    """Move a decompressing stream to ``position`` by reading forward in small chunks.

    (ZipExtFile.seek would do the same with 16 MiB chunks; rewinding restarts the member.)
    """
    if position < stream.tell():
        stream.seek(0)
    left = position - stream.tell()
    while left > 0:
        skipped = len(stream.read(min(left, _SKIP_CHUNK)))
        if not skipped:
            raise DatasetError(f"{name} is truncated")
        left -= skipped


_COMPACT_DTYPES = frozenset(np.dtype(name) for name in ("uint8", "int8", "int16", "float16", "bool"))


def compact_dtype(stored: str | np.dtype[Any]) -> np.dtype[Any]:
    """The type rows are moved in: the stored one if narrower than float32 (and one torch
    holds), else float32."""
    dtype = np.dtype(stored).newbyteorder("=")
    return dtype if dtype in _COMPACT_DTYPES else np.dtype(np.float32)


def describe_layout(place: Place, data_format: str, size: int, role: str, **npz_limits: Any) -> ArrayLayout:
    """The layout of an ``.npy`` or ``.npz`` (``data_format``) of ``size`` bytes wherever it
    lies: a local file's header read from disk, an object's from its first bytes or its zip
    directory (``npz_limits``: the bounds of a compressed member, see :func:`describe_npz_stream`)."""
    remote = place.remote
    if remote is not None:
        return describe_remote_array(remote, data_format, size, role, **npz_limits)
    path = Path(place.location)
    if data_format == "npy":
        return describe_npy(path, place.shown)
    return describe_npz(path, name=place.shown, **npz_limits)


def describe_remote_array(
    source: RemoteSource, data_format: str, size: int, role: str, **npz_limits: Any
) -> ArrayLayout:
    """The layout of an ``.npy`` or ``.npz`` object, from its first bytes or its zip directory
    (``npz_limits``: the bounds of a compressed member, see :func:`describe_npz_stream`)."""
    fs = source.filesystem()
    try:
        if data_format == "npy":
            head = fs.cat_file(source.key, start=0, end=min(size, _HEADER_BYTES))
            layout = describe_npy_stream(io.BytesIO(head), source.name, size)
        else:
            with fs.open(source.key, "rb", block_size=_DIRECTORY_BLOCK, cache_type="readahead") as stream:
                layout = describe_npz_stream(stream, source.name, size, **npz_limits)
    except Exception as exc:  # noqa: BLE001
        raise remote_error(exc, source, role) from exc
    if layout.fortran_order and layout.storage != "npz-compressed":
        raise DatasetError(
            f"{source.name} is Fortran-ordered: its rows are not contiguous and cannot be read by ranges; "
            "save it with np.ascontiguousarray"
        )
    return layout
