"""Every error as ``application/problem+json`` (RFC 9457): the typed errors, validation, the rest.

A :class:`~bnrecal.errors.BnrecalError` answers with the status and title its class has in
``service.jobserver.problems.PROBLEM_KINDS`` (the one table of them); a request
that fails validation is a 422 whose ``field`` names the first bad field; anything
unexpected is a 500 that says so without a stack trace (the server log has it).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException as StarletteHTTPException

from bnrecal.service.jobserver.problems import FieldProblem, Problem, http_status, problem_of
from bnrecal.errors import BnrecalError

PROBLEM_MEDIA_TYPE = "application/problem+json"
VALIDATION_TYPE = "https://bnrecal.dev/problems/validation"
_SHOWN_ERRORS = 5
RETRY_AFTER_S = 5
"""What a 503 (a server shutting down) or a 429 (a full queue) tells clients to wait before they retry."""

log = logging.getLogger("bnrecal.api")


def problem_response(problem: Problem, headers: dict[str, str] | None = None) -> JSONResponse:
    """A problem as a response with its status."""
    return JSONResponse(problem.body(), status_code=problem.status, media_type=PROBLEM_MEDIA_TYPE, headers=headers)


def field_name(location: tuple[Any, ...] | list[Any]) -> str:
    """``("body", "onnx", "opset")`` -> ``onnx.opset``; headers and queries keep their origin."""
    parts = [str(part) for part in location]
    if parts and parts[0] in ("query", "header", "path", "cookie"):
        return f"{parts[0]} {'.'.join(parts[1:])}".strip()
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(part for part in parts if not _is_union_tag(part)) or "body"


def _is_union_tag(part: Any) -> bool:
    """Pydantic's names for union members in an error location (``constrained-str``, ``DataPath``)."""
    text = str(part)
    return isinstance(part, str) and (text[:1].isupper() or "-" in text or "[" in text)


async def _bnrecal_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BnrecalError)
    headers = None
    status = http_status(exc)
    if status == 401:
        headers = {"WWW-Authenticate": 'Bearer realm="bnrecal"'}
    elif status in (429, 503):
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return problem_response(problem_of(exc), headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    invalid_json = next((error for error in exc.errors() if error.get("type") == "json_invalid"), None)
    if invalid_json is not None:
        return problem_response(_invalid_json_problem(invalid_json, exc.body))
    errors = [FieldProblem(field=field_name(error.get("loc", ())), message=_message(error)) for error in exc.errors()]
    shown = "; ".join(f"{e.field}: {e.message}" for e in errors[:_SHOWN_ERRORS])
    more = f" (and {len(errors) - _SHOWN_ERRORS} more)" if len(errors) > _SHOWN_ERRORS else ""
    return problem_response(Problem(
        type=VALIDATION_TYPE, title="Invalid request", status=422, detail=(shown or "the request is invalid") + more,
        field=errors[0].field if errors else None, errors=errors,
    ))


_TYPE_ERRORS = frozenset({"int_type", "bool_type", "string_type", "float_type", "dict_type", "list_type"})


def _message(error: ErrorDetails) -> str:
    """Pydantic's message, with what was sent where the type was wrong: ``Input should be a
    valid integer, got the string "2"`` says why a value that looks right is refused."""
    message = str(error.get("msg", "invalid"))
    if error.get("type") in _TYPE_ERRORS and "input" in error:
        message += f", got {_json_kind(error['input'])}"
    return message


def _json_kind(value: Any) -> str:
    """A JSON value as a client would recognise it: ``true``, ``the string "2"``, ``an object``."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        shown = json.dumps(value[:40] + ("..." if len(value) > 40 else ""))
        return f"the string {shown}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    return "an object" if isinstance(value, dict) else "an array" if isinstance(value, list) else type(value).__name__


def _invalid_json_problem(error: ErrorDetails, body: Any) -> Problem:
    """A body that is not JSON at all: where it breaks, as line and column; no field to name.

    FastAPI puts the character offset of the decode error where a field path would be
    (``("body", 9)``), which is not a field, so it is turned into a position instead.
    """
    location = error.get("loc", ())
    offset = location[-1] if location and isinstance(location[-1], int) else None
    reason = str((error.get("ctx") or {}).get("error") or "cannot decode it")
    where = ""
    if offset is not None and isinstance(body, (str, bytes)):
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        position = json.JSONDecodeError(reason, text, min(offset, len(text)))
        where = f" at line {position.lineno} column {position.colno}"
    elif offset is not None:
        where = f" at character {offset + 1}"
    return Problem(type=VALIDATION_TYPE, title="Invalid request", status=422,
                   detail=f"the request body is not valid JSON: {reason}{where}", field=None, errors=[])


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    try:
        title = HTTPStatus(exc.status_code).phrase
    except ValueError:
        title = "Error"
    detail = exc.detail if isinstance(exc.detail, str) else title
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no route {request.url.path}"
    problem = Problem(type="about:blank", title=title, status=exc.status_code, detail=detail)
    return problem_response(problem, dict(exc.headers) if exc.headers else None)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return problem_response(Problem(
        type="https://bnrecal.dev/problems/internal", title="Internal error", status=500,
        detail=f"an unexpected {type(exc).__name__} occurred; the server log has the details",
    ))


class ContainUnexpectedErrors:
    """Answer an unexpected error with the 500 problem and keep the connection serving.

    Starlette's outermost error middleware re-raises an error after answering it, so uvicorn
    also logs it as its own and may drop the client's connection (its next request reset).
    Inside it, this answers and stops there. An error after the response began (a download
    cut off because its bytes did not match their digest) is raised on, which cuts the
    connection: the client must see that the body is incomplete."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - answered as the 500 problem; the log has it
            if started:
                raise
            response = await _unexpected_error(Request(scope), exc)
            await response(scope, receive, send)


def install_problem_handlers(app: FastAPI) -> None:
    """Render every error of ``app`` as problem+json."""
    app.add_exception_handler(BnrecalError, _bnrecal_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(ContainUnexpectedErrors)
    install_problem_openapi(app)


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for problem responses (documented as problem+json by :func:`install_problem_openapi`)."""
    return {status: {"model": Problem, "description": HTTPStatus(status).phrase} for status in statuses}


PROBLEM_RESPONSES = problem_responses(401, 404, 422)
"""The problem responses every ``/v1`` operation may give."""


def install_problem_openapi(app: FastAPI) -> None:
    """Document error responses under ``application/problem+json``, the media type they are sent with."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operation in (op for path in schema.get("paths", {}).values() for op in path.values()):
                for status, response in operation.get("responses", {}).items():
                    content = response.get("content", {})
                    if status[:1] in ("4", "5") and "application/json" in content:
                        content[PROBLEM_MEDIA_TYPE] = content.pop("application/json")
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
