"""Object storage (``s3://bucket/key-or-prefix``), reached through fsspec: which URIs are
accepted, the filesystem and its errors, an object's size, a download, a seekable file.

What the bytes are is the formats' concern: they describe data from a few small reads (an
``.npy`` header, an ``.npz``'s zip directory, a prefix's listing) and each rank fetches only
its own samples through :class:`~workers.data.storage.files.Place`.

Credentials and the endpoint come from the standard AWS environment and configuration of
the process (``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``, instance
roles, ...), never from the URI: a URI with user info, a port, a query or a fragment is
refused. Only ``s3`` is accepted today; the rest goes through fsspec, so another scheme
would need only its filesystem here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from bnrecal.errors import DatasetError, SpecError

SCHEMES = ("s3",)
_URI_START = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_STREAM_BLOCK = 1 << 20  # readahead of a streamed (compressed npz) member


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
