"""JSON request bodies read strictly: UTF-8 only, nested at most ``MAX_JSON_DEPTH`` levels.

FastAPI decodes a JSON body with ``json.loads``: bytes that are not UTF-8 and a body nested
thousands of levels deep (``RecursionError``) both end in its generic 400 "There was an
error parsing the body", which says neither what nor where. Here both are decode errors
with a position, so they reach the client as the documented 422 "the request body is not
valid JSON: ... at line L column C", like any other malformed body.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

MAX_JSON_DEPTH = 32
"""How deep a request body may nest arrays and objects: a job spec needs about 10 (a
transformers config in ``model_kwargs``), the parser's recursion limit is near 1000."""

_UTF8_BOM = "\ufeff"
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)
"""A whole string (whose brackets do not count; an unterminated one runs to the end) or a bracket."""


def parse_json_body(body: bytes) -> Any:
    """The JSON value of a request body, or a ``json.JSONDecodeError`` that says what is
    wrong and where: a byte that is not UTF-8, nesting past ``MAX_JSON_DEPTH``, bad syntax.

    A leading UTF-8 byte order mark is ignored, as RFC 8259 allows.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        position = len(body[: exc.start].decode("utf-8"))
        raise json.JSONDecodeError(
            f"byte 0x{body[exc.start]:02x} is not UTF-8 (a JSON body must be UTF-8)",
            body.decode("utf-8", "replace"),
            position,
        ) from None
    text = text.removeprefix(_UTF8_BOM)
    _check_depth(text)
    return json.loads(text)


def _check_depth(text: str) -> None:
    """Refuse ``text`` where its arrays and objects nest deeper than ``MAX_JSON_DEPTH``,
    at the bracket that goes too deep. Free for a body with few brackets (every job spec)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return
    depth = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise json.JSONDecodeError(
                    f"arrays and objects nest deeper than {MAX_JSON_DEPTH} levels", text, match.start()
                )
        elif token in ("]", "}"):
            depth -= 1


class JsonBodyRequest(Request):
    """A request whose ``json()`` is :func:`parse_json_body`."""

    async def json(self) -> Any:
        """The body as JSON, decoded strictly (see :func:`parse_json_body`)."""
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class JsonBodyRoute(APIRoute):
    """A route that reads its JSON body with :class:`JsonBodyRequest`: the route class of
    every router whose operations take a JSON body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler, given the strict request."""
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            return await handler(JsonBodyRequest(request.scope, request.receive))

        return route_handler
