"""Serving stored blobs: the file, its digest as the ``ETag``, and 304 for a client that has it.

Every download is checked against the digest it is served under (docs/api.md, "Blobs"): a
whole-file download streams through a hash and holds back its last chunk until the hash is
known; when the bytes do not match, the blob is quarantined and the connection is cut
before the body is complete, so a client never receives a damaged file as if it were
whole. A range request hashes the whole file first and answers 404 when it is damaged.
``HEAD`` and 304 read no bytes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import anyio
from fastapi import Request, Response
from fastapi.responses import FileResponse
from starlette.types import Receive, Scope, Send

from bnrecal.service.jobserver.storage.blobs import BlobStore
from bnrecal.service.jobserver.problems import problem_of
from bnrecal.errors import CorruptBlobError, NotFoundError
from bnrecal.workers.files import stream_digest

from .problems import problem_response

CACHE_CONTROL = "private, max-age=31536000, immutable"  # a digest names the same bytes forever
CHUNK_BYTES = 1024 * 1024  # bytes read, hashed and sent at a time

OnCorrupt = Callable[[int | None], CorruptBlobError]
"""Quarantines a blob found damaged (given the inode read) and returns the error."""


def etag_of(digest: str) -> str:
    """The strong ETag of a blob: its quoted digest."""
    return f'"{digest}"'


class VerifiedFileResponse(FileResponse):
    """A stored blob's file, sent only as far as its bytes hash to ``digest``."""

    chunk_size = CHUNK_BYTES

    def __init__(self, path: Path, digest: str, on_corrupt: OnCorrupt, **kwargs: object) -> None:
        super().__init__(path, stat_result=os.stat(path), **kwargs)  # type: ignore[arg-type]
        self.digest = digest
        self.on_corrupt = on_corrupt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extensions = {k: v for k, v in scope.get("extensions", {}).items() if k != "http.response.pathsend"}
        scope = {**scope, "extensions": extensions}  # the bytes go through the hash, never sent by path
        is_get = scope.get("method", "GET").upper() == "GET"
        if is_get and any(name == b"range" for name, _ in scope.get("headers", [])):
            inode, good = await anyio.to_thread.run_sync(self._hash_whole)
            if not good:
                error = await anyio.to_thread.run_sync(self.on_corrupt, inode)
                gone = NotFoundError(f"no blob {self.digest}: {error.message}")
                await problem_response(problem_of(gone))(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def _hash_whole(self) -> tuple[int, bool]:
        with open(self.path, "rb") as handle:
            inode = os.fstat(handle.fileno()).st_ino
            return inode, stream_digest(handle) == self.digest

    async def _handle_simple(self, send: Send, send_header_only: bool, send_pathsend: bool) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if send_header_only:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        hashed = hashlib.sha256()
        held = b""
        async with self._open_file() as file:
            inode = await anyio.to_thread.run_sync(lambda: os.fstat(file.wrapped.fileno()).st_ino)
            while chunk := await file.read(self.chunk_size):
                hashed.update(chunk)
                if held:
                    await send({"type": "http.response.body", "body": held, "more_body": True})
                held = chunk
        if "sha256:" + hashed.hexdigest() != self.digest:
            # The response has started: raising cuts the connection before the body is complete.
            raise await anyio.to_thread.run_sync(self.on_corrupt, inode)
        await send({"type": "http.response.body", "body": held, "more_body": False})


def blob_response(
    request: Request,
    blobs: BlobStore,
    tenant: str,
    digest: str,
    file: Path,
    media_type: str = "application/octet-stream",
    filename: str | None = None,
) -> Response:
    """The blob's bytes, checked against its digest as they are sent (or only headers for
    HEAD, or 304 when ``If-None-Match`` matches)."""
    etag = etag_of(digest)
    headers = {"ETag": etag, "Cache-Control": CACHE_CONTROL, "X-Content-Digest": digest}
    wanted = request.headers.get("if-none-match", "")
    if wanted and (wanted.strip() == "*" or etag in [tag.strip().removeprefix("W/") for tag in wanted.split(",")]):
        return Response(status_code=304, headers=headers)

    def on_corrupt(inode: int | None) -> CorruptBlobError:
        return blobs.corrupt(tenant, digest, "download", inode=inode)

    return VerifiedFileResponse(file, digest, on_corrupt, media_type=media_type, filename=filename, headers=headers)
