"""A failed job's problem object (problem+json): what went wrong, and the job spec field at fault.

Every input error names the field to fix, so a client (the web page's form, the CLI's
one line) can point at it: the error's own ``field`` where it has one, else the field
its kind implies (data the model rejects: ``data``; an unreadable checkpoint: ``checkpoint``).
"""

from __future__ import annotations

from typing import Any

from bnrecal.workers.errors import (
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


def problem_of(exc: BnrecalError, spec: Any = None) -> dict[str, Any]:
    """The problem+json object of an error (``type``, ``title``, ``status``, ``detail`` and its
    context: the ``field`` at fault, the rank and node of a run failure)."""
    problem: dict[str, Any] = {"type": exc.type, "title": exc.title, "status": exc.status, "detail": exc.message}
    field = fault_field(exc, spec)
    if field:
        problem["field"] = field
    if isinstance(exc, RunError):
        if exc.rank is not None:
            problem["rank"] = exc.rank
        if exc.node is not None:
            problem["node"] = exc.node
    return problem
