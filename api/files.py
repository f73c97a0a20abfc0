"""Serving stored blobs: the file, its digest as the ``ETag``, and 304 for a client that has it."""

from __future__ import annotations

from pathlib import Path

from fastapi import Request, Response
from fastapi.responses import FileResponse

CACHE_CONTROL = "private, max-age=31536000, immutable"  # a digest names the same bytes forever


def etag_of(digest: str) -> str:
    """The strong ETag of a blob: its quoted digest."""
    return f'"{digest}"'


def blob_response(
    request: Request, file: Path, digest: str, media_type: str = "application/octet-stream", filename: str | None = None
) -> Response:
    """The blob's bytes (or only headers for HEAD, or 304 when ``If-None-Match`` matches)."""
    etag = etag_of(digest)
    headers = {"ETag": etag, "Cache-Control": CACHE_CONTROL, "X-Content-Digest": digest}
    wanted = request.headers.get("if-none-match", "")
    if wanted and (wanted.strip() == "*" or etag in [tag.strip().removeprefix("W/") for tag in wanted.split(",")]):
        return Response(status_code=304, headers=headers)
    return FileResponse(file, media_type=media_type, filename=filename, headers=headers)
