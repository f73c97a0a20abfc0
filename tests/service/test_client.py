"""The Python client's protocol pieces: Server-Sent Event parsing, problem -> typed error,
and what an upload sends (the file's name beside its bytes)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import httpx
import pytest

from bnrecal.service.cli.console import exit_code as cli_exit_code
from bnrecal.service.client import BnrecalClient, error_from_problem, parse_events, problem_in
from bnrecal.service.jobserver.problems import problem_of, problem_type
from bnrecal.errors import (
    CancelledError,
    CheckpointError,
    ConflictError,
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
    again = error_from_problem(problem_of(error))
    assert type(again) is type(error)
    assert again.message == error.message and cli_exit_code(again) == exit_code


def test_spec_errors_keep_their_field_and_unknown_types_go_by_status():
    error = error_from_problem(problem_in(
        {"type": problem_type(SpecError), "status": 422, "detail": "workers must be >= 1", "field": "workers"}, 422, "x"
    ))
    assert isinstance(error, SpecError) and error.field == "workers"
    assert type(error_from_problem(problem_in({"type": "about:blank", "detail": "nope"}, 405, "x"))) is InputError
    assert type(error_from_problem(problem_in({"detail": "bad gateway"}, 502, "Bad Gateway"))) is RunError
    # an answer that is no problem at all (a proxy's page) still comes back as the status's error
    assert type(error_from_problem(problem_in("<html>gateway</html>", 502, "Bad Gateway"))) is RunError


def recorded_uploads(client: BnrecalClient) -> list[tuple[httpx.URL, bytes]]:
    """Point the client at an in-process handler that records each upload's URL and body."""
    sent: list[tuple[httpx.URL, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.url, request.read()))
        return httpx.Response(201, json={"digest": "sha256:" + "0" * 64, "size": len(sent[-1][1])})

    client._http = httpx.Client(base_url=client.server, transport=httpx.MockTransport(handler))
    return sent


def test_an_upload_sends_the_file_name_and_a_folder_its_own_name(tmp_path: Path):
    (tmp_path / "calib.txt").write_text("1,2\n")
    photos = tmp_path / "photos"
    (photos / "cats").mkdir(parents=True)
    (photos / "cats" / "a.png").write_bytes(b"png")
    with BnrecalClient("http://bnrecal.invalid") as client:
        sent = recorded_uploads(client)
        client.upload(tmp_path / "calib.txt")
        client.upload(photos)
        client.upload(tmp_path / "calib.txt", filename="renamed.csv")
    assert [(url.path, url.params.get("filename")) for url, _ in sent] == [
        ("/v1/blobs", "calib.txt"), ("/v1/blobs", "photos"), ("/v1/blobs", "renamed.csv"),
    ]
    assert sent[0][1] == b"1,2\n"
    with tarfile.open(fileobj=io.BytesIO(sent[1][1])) as tar:  # the folder goes as a tar, named after the folder
        assert tar.getnames() == ["cats/a.png"]
