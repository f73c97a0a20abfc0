"""The Python client's protocol pieces: Server-Sent Event parsing and problem -> typed error."""

from __future__ import annotations

import pytest

from service.client import error_from_problem, parse_events
from service.jobs import ConflictError
from workers.errors import (
    CancelledError,
    CheckpointError,
    InputError,
    NotFoundError,
    RunError,
    SpecError,
)


def test_events_are_parsed_with_ids_kinds_and_data():
    lines = [
        ": keep-alive",
        "",
        "id: 3",
        "event: status",
        'data: {"status": "running",',
        'data: "progress": {"samples_done": 0}}',
        "",
        "id: 4",
        "event: progress",
        'data:{"status":"running"}',
        "",
        "data: {}",  # no blank line after it: an incomplete event is dropped
    ]
    events = list(parse_events(iter(lines)))
    assert [(e.id, e.kind) for e in events] == [(3, "status"), (4, "progress")]
    assert events[0].data == {"status": "running", "progress": {"samples_done": 0}}
    assert events[1].data == {"status": "running"}


@pytest.mark.parametrize(
    ("error", "exit_code"),
    [
        (CheckpointError("checkpoint m.pt needs a full unpickle"), 2),
        (NotFoundError("no job"), 2),
        (CancelledError("the job was cancelled"), 1),
        (RunError("rank 1 died", rank=1), 1),
        (ConflictError("already succeeded"), 2),
    ],
)
def test_a_problem_comes_back_as_the_error_the_server_raised(error, exit_code):
    problem = {"type": error.type, "title": error.title, "status": error.status, "detail": error.message}
    again = error_from_problem(problem)
    assert type(again) is type(error)
    assert again.message == error.message and again.exit_code == exit_code


def test_spec_errors_keep_their_field_and_unknown_types_go_by_status():
    error = error_from_problem(
        {"type": SpecError("x").type, "status": 422, "detail": "workers must be >= 1", "field": "workers"}
    )
    assert isinstance(error, SpecError) and error.field == "workers"
    assert type(error_from_problem({"type": "about:blank", "status": 405, "detail": "nope"})) is InputError
    assert type(error_from_problem({"status": 502, "detail": "bad gateway"})) is RunError
