"""Errors as problem+json objects (RFC 9457): the HTTP status, title and ``type`` of each
error class, and a failed job's problem with the job spec field at fault.

:mod:`bnrecal.errors` knows nothing of HTTP; this table is where an error becomes an HTTP
answer. It lives with the job server rather than in ``api`` because the job server stores
a failed job's problem (and the client reads one back into the error it stands for), and
``service`` never imports ``api``. ``api.problems`` renders it. Each class of the tree has
its own row; a class defined elsewhere takes the row of its nearest ancestor, the same way
a class attribute would be found (tests/service/jobserver/test_problems.py keeps the table complete).

Every input error names the field to fix, so a client (the web page's form, the CLI's
one line) can point at it: the error's own ``field`` where it has one, else the field
its kind implies (data the model rejects: ``data``; an unreadable checkpoint: ``checkpoint``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

import bnrecal.errors as errors
from bnrecal.errors import (
    ArchitectureError,
    BnrecalError,
    CheckpointError,
    DatasetError,
    ModelInputError,
    NoBatchNormError,
    ProgramError,
    RunError,
    UnsupportedLayerError,
)

PROBLEM_TYPE_BASE = "https://bnrecal.dev/problems/"


@dataclass(frozen=True)
class ProblemKind:
    """How one error class answers over HTTP: its status and the problem's ``title``."""

    status: int
    title: str


PROBLEM_KINDS: dict[type[BnrecalError], ProblemKind] = {
    errors.BnrecalError: ProblemKind(500, "Internal error"),
    errors.InputError: ProblemKind(400, "Bad input"),
    errors.ArchitectureError: ProblemKind(422, "Unknown or disallowed architecture"),
    errors.CheckpointError: ProblemKind(422, "Invalid checkpoint"),
    errors.ProgramError: ProblemKind(422, "Invalid program"),
    errors.DatasetError: ProblemKind(422, "Invalid calibration data"),
    errors.DatasetOptionError: ProblemKind(422, "Invalid calibration data"),
    errors.ModelInputError: ProblemKind(422, "Data does not fit the model"),
    errors.EvaluationError: ProblemKind(400, "Cannot evaluate"),
    errors.NoBatchNormError: ProblemKind(422, "No BatchNorm layer to recalibrate"),
    errors.UnsupportedLayerError: ProblemKind(422, "BatchNorm layer cannot be calibrated"),
    errors.SpecError: ProblemKind(422, "Invalid job specification"),
    errors.NotFoundError: ProblemKind(404, "Not found"),
    errors.ConflictError: ProblemKind(409, "Conflict"),
    errors.AuthenticationError: ProblemKind(401, "Unauthorized"),
    errors.PayloadTooLargeError: ProblemKind(413, "Payload too large"),
    errors.QuotaExceededError: ProblemKind(413, "Storage quota exceeded"),
    errors.TooManyJobsError: ProblemKind(429, "Too many queued jobs"),
    errors.TooManyStreamsError: ProblemKind(429, "Too many open streams"),
    errors.CorruptBlobError: ProblemKind(422, "Corrupt blob"),
    errors.HeadersTooLargeError: ProblemKind(431, "Request header fields too large"),
    errors.ServiceUnavailableError: ProblemKind(503, "Service unavailable"),
    errors.RunError: ProblemKind(500, "Calibration run failed"),
    errors.CallOrderError: ProblemKind(500, "BatchNorm call order differs between ranks"),
    errors.CancelledError: ProblemKind(409, "Cancelled"),
    errors.ExportError: ProblemKind(500, "ONNX export failed"),
    errors.Int8GuardError: ProblemKind(500, "INT8 file failed its accuracy guard"),
    errors.Int8GuardUnreachableError: ProblemKind(500, "INT8 accuracy guard cannot hold"),
    errors.InsufficientStorageError: ProblemKind(507, "Insufficient storage"),
    errors.TrackingError: ProblemKind(502, "Cannot log to MLflow"),
}
"""Every class of :mod:`bnrecal.errors` and how it answers over HTTP."""


def problem_kind(error: BnrecalError | type[BnrecalError]) -> ProblemKind:
    """The status and title of an error (or error class): its own row, else its nearest
    ancestor's (in method resolution order, as a class attribute would be found)."""
    cls = error if isinstance(error, type) else type(error)
    return next(PROBLEM_KINDS[base] for base in cls.__mro__ if base in PROBLEM_KINDS)


def http_status(error: BnrecalError | type[BnrecalError]) -> int:
    """The HTTP status an error answers with."""
    return problem_kind(error).status


def problem_type(error: BnrecalError | type[BnrecalError]) -> str:
    """The problem ``type`` of an error class, a stable URI made from its name
    (``SpecError`` -> ``https://bnrecal.dev/problems/spec``): how a client tells which
    class a problem stands for."""
    cls = error if isinstance(error, type) else type(error)
    name = cls.__name__.removesuffix("Error") or "Bnrecal"
    return PROBLEM_TYPE_BASE + "".join(
        "-" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name)
    )


def error_classes() -> dict[str, type[BnrecalError]]:
    """Each problem ``type`` and the error class it stands for (every class of the tree)."""
    classes: dict[str, type[BnrecalError]] = {}
    pending: list[type[BnrecalError]] = [BnrecalError]
    while pending:
        cls = pending.pop()
        classes[problem_type(cls)] = cls
        pending.extend(cls.__subclasses__())
    return classes


FAULT_FIELDS: tuple[tuple[type[BnrecalError], str], ...] = (
    (ArchitectureError, "arch"),
    (CheckpointError, "checkpoint"),
    (ProgramError, "program"),
    (ModelInputError, "data"),
    (DatasetError, "data"),
    (NoBatchNormError, "model"),
    (UnsupportedLayerError, "model"),
)
"""The spec field at fault for each kind of input error that names none itself; ``model``
stands for ``program`` or ``arch``, whichever the job has."""


def fault_field(exc: BnrecalError, spec: Any = None) -> str | None:
    """The job spec field an error puts the blame on: its own ``field``, else the one its
    kind implies (the data for data the model rejects); None for a run or server failure.
    ``spec`` (the job's ``JobSpec``) tells a program's job from an architecture's."""
    field = getattr(exc, "field", None)
    if isinstance(field, str) and field:
        return field
    for kind, name in FAULT_FIELDS:
        if isinstance(exc, kind):
            if name == "model":
                return "program" if getattr(spec, "program", None) is not None else "arch"
            return name
    return None


class FieldProblem(BaseModel):
    """One invalid field of a request (a validation problem's ``errors[]``)."""

    field: str
    message: str


class Problem(BaseModel):
    """An error as problem+json (RFC 9457 problem details): what the API answers, what a
    failed job stores, and what the client turns back into the error it stands for.
    ``field`` names the field to fix, ``rank``/``node`` where a run failed, ``errors`` every
    invalid field of a request. Written with the fields it was given (:meth:`body`): a field
    never set is left out, one set to None is ``null``. Fields of a newer server are kept."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    field: str | None = None
    rank: int | None = None
    node: str | None = None
    errors: list[FieldProblem] | None = None

    @model_serializer(mode="wrap")
    def _as_given(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        unset = {"field", "rank", "node", "errors"} - self.model_fields_set
        return {key: value for key, value in data.items() if key not in unset}

    def body(self) -> dict[str, Any]:
        """The JSON object, as answered and stored."""
        return self.model_dump(mode="json")


def problem_of(exc: BnrecalError, spec: Any = None) -> Problem:
    """The problem of an error (``type``, ``title``, ``status``, ``detail`` and its context:
    the ``field`` at fault, the rank and node of a run failure)."""
    kind = problem_kind(exc)
    problem = Problem(type=problem_type(exc), title=kind.title, status=kind.status, detail=exc.message)
    field = fault_field(exc, spec)
    if field:
        problem.field = field
    if isinstance(exc, RunError):
        if exc.rank is not None:
            problem.rank = exc.rank
        if exc.node is not None:
            problem.node = exc.node
    return problem
