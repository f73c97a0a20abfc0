"""Calibration data in object storage (``s3://bucket/key-or-prefix``), read through fsspec.

The driver describes the data from a few small reads (an ``.npy`` header, an ``.npz``'s
zip directory and local header, a prefix's listing); each rank then fetches only its own
samples: byte ranges of ``.npy`` files and of uncompressed ``.npz`` members, or its own
image objects. A compressed ``.npz`` member cannot be read at an offset: it is streamed
from its start up to the rank's last row. Archives are downloaded whole and unpacked
into the local unpack cache.

Credentials and the endpoint come from the standard AWS environment and configuration of
the process (``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``, instance
roles, ...), never from the URI: a URI with user info, a port, a query or a fragment is
refused. Only ``s3`` is accepted today; the rest goes through fsspec, so another scheme
would need only its filesystem here.
"""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import numpy as np
import torch

from bnrecal.workers.data.formats.arrays import ArrayData, ArrayLayout, compact_dtype, describe_npy_stream, describe_npz_stream
from bnrecal.workers.data.formats.images import ImageData, ImageListing, is_ignored_part, is_image_name, listing_of
from bnrecal.workers.data.reading.order import gather_runs
from bnrecal.workers.data.formats.transform import ImageTransform, decode_image
from bnrecal.errors import DatasetError, SpecError

SCHEMES = ("s3",)
_URI_START = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_HEADER_BYTES = 16_384  # an npy header is at most 10_012 bytes (numpy's bound, checked by read_npy_header)
_STREAM_BLOCK = 1 << 20  # readahead of a streamed (compressed npz) member
_DIRECTORY_BLOCK = 1 << 16  # readahead while reading an npz's zip directory and local header


def is_data_uri(value: object) -> bool:
    """Whether ``value`` is written as a URI (``scheme://...``) rather than a local path."""
    return isinstance(value, str) and bool(_URI_START.match(value))


@dataclass(frozen=True)
class RemoteSource:
    """An object or prefix in object storage, and the endpoint to reach it (None: the AWS
    environment's own, e.g. ``AWS_ENDPOINT_URL``). Picklable: it travels to the ranks."""

    uri: str
    endpoint_url: str | None = None

    @property
    def key(self) -> str:
        """``bucket/key`` as fsspec names it."""
        return self.uri.split("://", 1)[1].rstrip("/")

    @property
    def name(self) -> str:
        """The object's (or prefix's) last path component, as messages call it."""
        return self.key.rsplit("/", 1)[-1]

    def filesystem(self) -> Any:
        """The fsspec filesystem of this source (cached per process by fsspec)."""
        return s3_filesystem(self.endpoint_url)


def parse_data_uri(uri: str, field: str = "data.uri") -> str:
    """Check a data URI and return it normalised; refuse what could carry credentials or
    reach anything but an object or prefix (``field`` names the spec field or flag)."""
    if not is_data_uri(uri):
        raise SpecError(f"{field} must be a URI like s3://bucket/prefix, got {uri!r}", field=field)
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise SpecError(f"{field}: scheme {scheme}:// is not supported; use s3://bucket/key", field=field)
    if "@" in parts.netloc or ":" in parts.netloc:
        raise SpecError(
            f"{field} must not carry credentials or a port; the server uses its own AWS configuration", field=field
        )
    if parts.query or parts.fragment or "?" in uri or "#" in uri:
        raise SpecError(f"{field} must not have a query string or fragment", field=field)
    if not _BUCKET.match(parts.netloc):
        raise SpecError(f"{field}: {parts.netloc!r} is not a valid bucket name", field=field)
    key = parts.path.lstrip("/")
    if any(ord(c) < 32 for c in key) or any(p in (".", "..") for p in key.split("/")):
        raise SpecError(f"{field}: the key {key!r} has control characters or . or .. components", field=field)
    return f"{scheme}://{parts.netloc}/{key}"


def uri_allowed(uri: str, allowed: Sequence[str]) -> bool:
    """Whether ``uri`` lies under one of the ``allowed`` prefixes: ``s3://bucket`` (the whole
    bucket) or ``s3://bucket/folder`` (that key and everything under ``folder/``, matched by
    whole path components, with or without a trailing ``/``)."""
    normalised = parse_data_uri(uri)
    for prefix in allowed:
        scheme, _, rest = prefix.partition("://")
        bucket, _, folder = rest.partition("/")
        here_scheme, _, here_rest = normalised.partition("://")
        here_bucket, _, key = here_rest.partition("/")
        if scheme.lower() != here_scheme or bucket != here_bucket:
            continue
        folder = folder.strip("/")
        if not folder or key.rstrip("/") == folder or key.startswith(folder + "/"):
            return True
    return False


def s3_filesystem(endpoint_url: str | None = None) -> Any:
    """An s3fs filesystem with the process's AWS credentials, failing fast on an unreachable
    endpoint (a few seconds, not botocore's minutes of retries)."""
    import fsspec

    options: dict[str, Any] = {
        "config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}},
        "use_listings_cache": False,
    }
    if endpoint_url:
        options["endpoint_url"] = endpoint_url
    return fsspec.filesystem("s3", **options)


def remote_error(exc: BaseException, source: RemoteSource, role: str) -> DatasetError:
    """A one-line DatasetError naming the URI for what the storage answered."""
    if isinstance(exc, DatasetError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return DatasetError(f"{role} not found: {source.uri}")
    if isinstance(exc, PermissionError):
        return DatasetError(f"{role} {source.uri}: access denied (check the server's AWS credentials)")
    detail = " ".join(str(exc).split())[:200] or type(exc).__name__
    return DatasetError(f"{role} {source.uri} cannot be read: {detail}")


def stat_object(source: RemoteSource, role: str) -> tuple[str, int]:
    """``("file", size)`` for an object, ``("directory", 0)`` for a prefix; missing raises."""
    fs = source.filesystem()
    try:
        info = fs.info(source.key)
    except Exception as exc:  # noqa: BLE001 - storage errors come in many types, all reported one way
        raise remote_error(exc, source, role) from exc
    if info.get("type") == "directory":
        return "directory", 0
    return "file", int(info.get("size") or 0)


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


def list_remote_images(source: RemoteSource, role: str) -> ImageListing:
    """The images under a prefix, by the same rules (and in the same order) as a local folder,
    wrapper folders included."""
    fs = source.filesystem()
    try:
        found = fs.find(source.key)
    except Exception as exc:  # noqa: BLE001
        raise remote_error(exc, source, role) from exc
    base = source.key + "/"
    names = [path[len(base):] for path in found if path.startswith(base)]
    names = [n for n in names if not any(is_ignored_part(p) for p in n.split("/"))]
    root = source.key
    while True:  # a top level of no image and a single folder is a wrapper
        top_files = [n for n in names if "/" not in n]
        folders = {n.split("/", 1)[0] for n in names if "/" in n}
        if any(is_image_name(n) for n in top_files) or len(folders) != 1:
            break
        (folder,) = folders
        root = f"{root}/{folder}"
        names = [n[len(folder) + 1:] for n in names if n.startswith(folder + "/")]
    return listing_of(Path(root), [n for n in names if is_image_name(n)], source.name or source.uri)


def fetch_object(source: RemoteSource, target: Path, max_bytes: int, role: str) -> Path:
    """Download an object (an archive) to ``target``, refusing one larger than ``max_bytes``."""
    _, size = stat_object(source, role)
    if size > max_bytes:
        raise DatasetError(f"{role} {source.uri} is {size} bytes, more than the {max_bytes} an archive may unpack to")
    try:
        source.filesystem().get_file(source.key, str(target))
    except Exception as exc:  # noqa: BLE001
        target.unlink(missing_ok=True)
        raise remote_error(exc, source, role) from exc
    return target


def open_remote_file(source: RemoteSource) -> IO[bytes]:
    """A seekable read-only file of the object (reads ahead by 1 MiB), e.g. for ``np.load``."""
    return source.filesystem().open(source.key, "rb", block_size=_STREAM_BLOCK, cache_type="readahead")


GATHER_GAP_BYTES = 256 * 1024
"""Rows of a remote array closer than this are fetched in one ranged read, gap included:
a request costs about as much as that many bytes of transfer."""


class RemoteArrayData(ArrayData):
    """Rows of an ``.npy`` object or ``.npz`` member: ``load`` fetches the byte range of the
    requested rows only (a compressed member is streamed from its start instead)."""

    def __init__(
        self, source: RemoteSource, layout: ArrayLayout, num_samples: int, order: np.ndarray | None = None
    ) -> None:
        super().__init__(source.uri, layout, num_samples, order)
        self.source = source
        self._file: IO[bytes] | None = None

    def _read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` in their compact type, fetched by one ranged read."""
        if self.layout.storage == "npz-compressed":
            return super()._read_rows(start, stop)
        return self._fetch_runs([(start, stop)])[0]

    def _gather(self, rows: np.ndarray) -> np.ndarray:
        """Rows in any order: their runs (rows up to ``GATHER_GAP_BYTES`` apart read through
        the gap) fetched concurrently in one ``cat_ranges`` call, then put back in order."""
        if self.layout.storage == "npz-compressed":
            return super()._gather(rows)
        row_bytes = self._row_bytes()
        permutation = np.argsort(rows, kind="stable")
        found = gather_runs(
            rows[permutation], None, max(0, GATHER_GAP_BYTES // max(1, row_bytes)), fetch=self._fetch_runs
        )
        out = np.empty_like(found)
        out[permutation] = found
        return out

    @property
    def _reads_ahead(self) -> bool:
        """Every read is a round trip: the rows of the next steps are fetched together."""
        return True

    def _row_bytes(self) -> int:
        return int(np.prod(self.sample_shape, dtype=np.int64)) * np.dtype(self.layout.dtype).itemsize

    def _fetch_runs(self, runs: list[tuple[int, int]]) -> list[np.ndarray]:
        """Each run of consecutive rows ``[start, stop)``, fetched concurrently, in the compact type."""
        stored = np.dtype(self.layout.dtype)
        dtype = compact_dtype(self.layout.dtype)
        row_bytes = self._row_bytes()
        starts = [self.layout.data_offset + a * row_bytes for a, _ in runs]
        ends = [self.layout.data_offset + b * row_bytes for _, b in runs]
        try:
            fs = self.source.filesystem()
            if len(runs) == 1:
                raws = [fs.cat_file(self.source.key, start=starts[0], end=ends[0])]
            else:
                raws = fs.cat_ranges([self.source.key] * len(runs), starts, ends)
        except Exception as exc:  # noqa: BLE001
            raise remote_error(exc, self.source, "calibration data") from exc
        parts = []
        for (a, b), raw in zip(runs, raws):
            if isinstance(raw, BaseException):
                raise remote_error(raw, self.source, "calibration data") from raw
            if len(raw) != (b - a) * row_bytes:
                raise DatasetError(f"{self.source.uri} changed since it was described (short read)")
            rows = np.frombuffer(raw, dtype=stored).reshape(b - a, *self.sample_shape)
            parts.append(np.array(rows, dtype=dtype, order="C"))
        return parts

    @property
    def memory_map(self) -> None:
        """Remote rows are never memory-mapped."""
        return None

    def _open(self) -> None:
        if self._stream is not None or self.layout.storage != "npz-compressed":
            return
        try:
            self._file = open_remote_file(self.source)
            self._zip = zipfile.ZipFile(self._file)
            self._stream = self._zip.open(self.layout.member or "")
        except Exception as exc:  # noqa: BLE001
            self.close()
            raise remote_error(exc, self.source, "calibration data") from exc

    def close(self) -> None:
        """Close the streamed member and its remote file."""
        super().close()
        if self._file is not None:
            self._file.close()
        self._file = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_file": None}


class RemoteImageData(ImageData):
    """Images under a prefix: ``load`` fetches only the requested objects, concurrently."""

    def __init__(
        self,
        source: RemoteSource,
        root: str,
        files: Sequence[str],
        transform: ImageTransform,
        *,
        classes: Sequence[str] = (),
        labels: Sequence[int] = (),
    ) -> None:
        super().__init__(root, files, transform, classes=classes, labels=labels)
        self.source = source

    def load_kept(self, start: int, stop: int) -> torch.Tensor:
        """Fetch, decode, resize and crop images ``[start, stop)`` to uint8 (``load`` normalises them)."""
        self._check_range(start, stop)
        if start == stop:
            return self._empty().to(torch.uint8)
        return torch.stack([decode_image(io.BytesIO(data), name, self.transform) for name, data in self.encoded(start, stop)])  # type: ignore[arg-type]

    def encoded(self, start: int, stop: int) -> list[tuple[str, bytes]]:
        """The objects' bytes ``[start, stop)``, fetched concurrently."""
        self._check_range(start, stop)
        names = self.files[start:stop]
        paths = [f"{self.root}/{name}" for name in names]
        if not paths:
            return []
        try:
            fetched = self.source.filesystem().cat(paths, on_error="raise")
        except Exception as exc:  # noqa: BLE001
            raise remote_error(exc, self.source, "calibration data") from exc
        return [(name, fetched[path]) for path, name in zip(paths, names)]
