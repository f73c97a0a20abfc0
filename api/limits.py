"""A cap on request bodies outside the streamed blob upload, enforced on the bytes received.

Job specs are small JSON documents; without a cap, a client could make the server read
an arbitrarily large body into memory before validation even starts.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bnrecal.service.jobserver.problems import problem_of
from bnrecal.errors import PayloadTooLargeError

from .problems import problem_response

MAX_BODY_BYTES = 1024 * 1024
STREAMED_PATHS = frozenset({"/v1/blobs"})  # has its own, larger cap, applied while streaming


class BodySizeLimit:
    """ASGI middleware: a request body past ``limit`` bytes is refused with 413 (problem+json).

    The body is read (at most ``limit`` bytes of it) before the route runs, then handed
    on unchanged.
    """

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in STREAMED_PATHS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                error = PayloadTooLargeError(f"request body exceeds {self.limit} bytes")
                await problem_response(problem_of(error))(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive channel that first gives back ``messages``, then the real ones."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
