"""``api/http11.py`` subclasses uvicorn's h11 protocol, which is not uvicorn's public API:
these tests name each private part it leans on, so an upgrade of uvicorn or h11 that moves
one fails here, by name, before a malformed request meets a server (the behaviour itself,
a problem+json 400 or 431 the client receives, is ``test_bad_requests.py``'s and the abuse
probes')."""

from __future__ import annotations

import inspect

import h11
from h11 import _connection
from uvicorn.config import Config
from uvicorn.protocols.http import h11_impl

from bnrecal.api.http11 import ProblemH11Protocol, _Connection


def test_uvicorn_answers_an_unparseable_request_through_send_400_response():
    handle_events = inspect.getsource(h11_impl.H11Protocol.handle_events)
    assert "except h11.RemoteProtocolError" in handle_events and "self.send_400_response(" in handle_events
    assert list(inspect.signature(h11_impl.H11Protocol.send_400_response).parameters) == ["self", "msg"]
    assert ProblemH11Protocol.send_400_response is not h11_impl.H11Protocol.send_400_response


def test_the_protocol_keeps_the_attributes_the_subclass_uses():
    init = inspect.getsource(h11_impl.H11Protocol.__init__)
    for attribute in ("self.config", "self.conn", "self.loop", "self.transport"):
        assert attribute in init or attribute in inspect.getsource(h11_impl.H11Protocol), attribute
    assert "h11_max_incomplete_event_size" in inspect.signature(Config).parameters
    for hook in ("data_received", "eof_received", "connection_lost"):
        assert callable(getattr(h11_impl.H11Protocol, hook)), hook
    assert isinstance(h11_impl.STATUS_PHRASES[431], bytes)


def test_h11_still_keeps_what_the_refusal_reads():
    assert isinstance(_connection.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, int)
    connection = _Connection(h11.SERVER, 64)
    connection.receive_data(b"GET / HTTP/1.1\r\nX-Long: " + b"a" * 200)
    try:
        connection.next_event()
    except h11.RemoteProtocolError as exc:
        assert connection.error is exc
    else:
        raise AssertionError("h11 no longer refuses headers over max_incomplete_event_size")
    data, closed = connection.trailing_data
    assert isinstance(data, bytes) and data.startswith(b"GET / HTTP/1.1") and closed is False
