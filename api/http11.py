"""HTTP/1.1 for the API server: uvicorn's h11 protocol, answering a request it cannot parse
with problem+json and the status h11 gives (431 for headers over the limit, else 400).

uvicorn's own answer to such a request is a ``text/plain`` 400, after which it closes the
socket with the rest of the request still unread. The kernel then resets the connection,
and a client still sending (a 1 MB ``Authorization`` header) sees "connection reset by
peer" instead of any answer. Here the answer is sent, the sending side shut, and what the
client still sends read and dropped (for a bounded time and size) until it closes, so the
answer arrives. ``bnrecal serve`` runs this protocol (``service.cli.remote.HTTP_PROTOCOL``).

uvicorn's ``H11Protocol`` and h11's ``_connection`` are not public APIs: every private part
used here is named by ``tests/api/test_http11.py``, which fails when an upgrade moves one.
"""

from __future__ import annotations

import asyncio
import json
import re

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from bnrecal.service.jobserver.problems import http_status, problem_of
from bnrecal.errors import BnrecalError, HeadersTooLargeError, InputError

from .problems import PROBLEM_MEDIA_TYPE

LINGER_S = 5.0
"""How long the rest of a refused request is read after the answer, at most."""
LINGER_BYTES = 16 * 1024 * 1024
"""How much of the rest of a refused request is read after the answer, at most."""

_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")


class _Connection(h11.Connection):
    """h11's server connection, keeping the protocol error it raised for the answer."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> object:
        """h11's next event; a protocol error is kept, then raised as before."""
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.error = exc
            raise


class ProblemH11Protocol(H11Protocol):
    """uvicorn's h11 protocol whose refusals of unparseable requests are problem+json
    answers the client receives (see the module's docstring)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        limit = self.config.h11_max_incomplete_event_size
        self.max_header_bytes = limit if limit is not None else DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = _Connection(h11.SERVER, self.max_header_bytes)
        self._linger: asyncio.TimerHandle | None = None
        self._dropped = 0

    def send_400_response(self, msg: str) -> None:
        """Answer the request h11 refused with problem+json, then linger until the client closes."""
        assert isinstance(self.conn, _Connection)
        error = refusal(self.conn.error, self.conn.trailing_data[0], self.max_header_bytes)
        body = json.dumps(problem_of(error).body()).encode()
        headers = [
            (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            for event in (
                h11.Response(status_code=http_status(error), headers=headers, reason=STATUS_PHRASES[http_status(error)]),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # an answer had already begun: nothing more can be said
            self.transport.close()
            return
        self._start_lingering()

    def _start_lingering(self) -> None:
        """Shut the sending side and read on, so unread bytes do not turn the close into a reset."""
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        """uvicorn's handling; while lingering, the bytes are dropped (up to ``LINGER_BYTES``)."""
        if self._linger is None:
            super().data_received(data)
            return
        self._dropped += len(data)
        if self._dropped > LINGER_BYTES:
            self.transport.close()

    def eof_received(self) -> bool | None:
        """The client has sent everything: a lingering connection can now close."""
        if self._linger is not None:
            self.transport.close()
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        """uvicorn's clean-up, and the linger timer's."""
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)


def refusal(error: h11.RemoteProtocolError | None, received: bytes, limit: int) -> BnrecalError:
    """The error to answer a request h11 refused with: 431 naming the longest header seen
    when the header section is over ``limit`` bytes, else 400 with h11's reason."""
    if error is not None and error.error_status_hint == 431:
        return HeadersTooLargeError(
            f"the request's headers are over the server's limit of {limit} bytes{_culprit(received)}"
        )
    reason = str(error) if error is not None and str(error) else "it cannot be parsed"
    return InputError(f"the request is not valid HTTP/1.1: {reason}")


def _culprit(received: bytes) -> str:
    """``(the Authorization header alone is at least N bytes)``: the longest line of the
    header section received so far, by name, or the request line (a long URL)."""
    lines = received.split(b"\r\n")
    longest = max(range(len(lines)), key=lambda i: len(lines[i]))
    size = len(lines[longest])
    if size < 1024:
        return ""
    if longest == 0:
        return f" (the request line, with its URL, is at least {size} bytes)"
    name = lines[longest].split(b":", 1)[0].strip()
    if not _TOKEN.fullmatch(name):
        return ""
    return f" (the {name.decode('ascii').title()} header alone is at least {size} bytes)"
