"""What the web page's job list stands on, over HTTP: ``GET /v1/jobs`` paged with a cursor and
filtered by status, the tenant's change stream ``GET /v1/jobs/events`` (its own jobs only,
bounded per key), ``HEAD /v1/blobs/{digest}``, ``POST /v1/jobs?dry_run=true``, and the job
view's input file names, phase timings and times."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from bnrecal.service.client import ServerEvent, parse_events
from bnrecal.service.jobserver.server import tenant_of_key
from tests.api.conftest import KEYS, named_upload, submit, upload, wait_for, write_samples
from tests.conftest import save_array

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, stale_checkpoint) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("feed")
    checkpoint = stale_checkpoint("team-model.pt")
    data, _ = write_samples(folder / "calib-16.npy", 16)
    evaluation, _ = write_samples(folder / "eval-8.npy", 8, seed=1)
    # too small for its 3x3 kernels: no clear cause a submission could tell (so it is accepted), fails running
    wrong = save_array(folder / "wrong-shape.npy", torch.randn(8, 3, 1, 1))
    return {"checkpoint": checkpoint, "data": data, "eval": evaluation, "wrong": wrong}


def spec_of(client: httpx.Client, files: dict[str, Path], **extra: Any) -> dict[str, Any]:
    return {"arch": "tests.nets:mixed_net", "checkpoint": named_upload(client, files["checkpoint"]),
            "data": named_upload(client, files["data"]), "batch_size": 8, **extra}


class EventReader:
    """The events of one open stream, read by a thread into a queue."""

    def __init__(self, client: httpx.Client, path: str) -> None:
        self.events: queue.Queue[ServerEvent | None] = queue.Queue()
        self._stack = client.stream("GET", path, timeout=httpx.Timeout(60, read=None))
        self.response = self._stack.__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        if self.response.status_code == 200:
            self._thread.start()

    def _read(self) -> None:
        try:
            for event in parse_events(self.response.iter_lines()):
                self.events.put(event)
        except httpx.HTTPError:
            pass
        self.events.put(None)

    def next_matching(self, kind: str, job_id: str | None, timeout: float) -> ServerEvent:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {kind} event for {job_id} within {timeout} s")
            event = self.events.get(timeout=left)
            assert event is not None, "the stream ended"
            if event.kind == kind and (job_id is None or event.data.get("id") == job_id):
                return event

    def drain(self) -> list[ServerEvent]:
        seen = []
        while not self.events.empty():
            event = self.events.get_nowait()
            if event is not None:
                seen.append(event)
        return seen

    def close(self) -> None:
        self.response.close()
        self._stack.__exit__(None, None, None)


@contextmanager
def open_stream(client: httpx.Client) -> Iterator[EventReader]:
    reader = EventReader(client, "/v1/jobs/events")
    try:
        yield reader
    finally:
        reader.close()


def test_the_change_stream_shows_a_new_job_at_once_and_never_another_keys(live_server, files):
    with live_server.client("feed") as client, live_server.client("alice") as other:
        others_spec = spec_of(other, files)
        spec = spec_of(client, files)
        with open_stream(client) as stream:
            assert stream.response.status_code == 200
            assert stream.response.headers["content-type"].startswith("text/event-stream")
            stream.next_matching("ready", None, timeout=10)
            started = time.monotonic()
            job = submit(client, spec)
            created = stream.next_matching("job", job["id"], timeout=2)
            assert time.monotonic() - started < 2
            assert created.data["status"] in ("queued", "running")
            assert created.data["inputs"]["checkpoint"]["filename"] == "team-model.pt"
            others = submit(other, others_spec)["id"]
            ended = stream.next_matching("job", job["id"], timeout=120)
            while ended.data["status"] not in ("succeeded", "failed", "cancelled"):
                ended = stream.next_matching("job", job["id"], timeout=120)
            assert ended.data["status"] == "succeeded", ended.data["error"]
            wait_for(other, others)
            assert client.delete(f"/v1/jobs/{job['id']}").status_code == 204
            stream.next_matching("deleted", job["id"], timeout=5)
            seen = stream.drain()
        assert all(event.data.get("id") != others for event in seen)


def raw_stream(url: str, key: str) -> tuple[socket.socket, bytes]:
    """A change stream opened on a plain socket (closing it closes the connection at once),
    and the head of its answer."""
    host, port = url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=30)
    request = f"GET /v1/jobs/events HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEYS[key]}\r\n\r\n"
    connection.sendall(request.encode())
    return connection, connection.recv(4096)


def test_the_change_stream_is_bounded_per_key_and_needs_a_key(live_server):
    with live_server.client(None) as anonymous:
        assert anonymous.get("/v1/jobs/events").status_code == 401
    opened = [raw_stream(live_server.url, "feed2") for _ in range(8)]
    try:
        assert all(head.startswith(b"HTTP/1.1 200") for _, head in opened)
        with live_server.client("feed2") as client:
            refused = client.get("/v1/jobs/events")
        assert refused.status_code == 429
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert "8 change streams" in refused.json()["detail"]
        others, head = raw_stream(live_server.url, "alice")  # another key has its own bound
        others.close()
        assert head.startswith(b"HTTP/1.1 200")
    finally:
        for connection, _ in opened:
            connection.close()
    deadline = time.monotonic() + 10  # closed streams free their places within a second or so
    while live_server.services.feed.open_tenant_streams(_tenant("feed2")):
        assert time.monotonic() < deadline, "closed streams still counted"
        time.sleep(0.05)
    again, head = raw_stream(live_server.url, "feed2")
    again.close()
    assert head.startswith(b"HTTP/1.1 200")


def _tenant(name: str) -> str:
    return tenant_of_key(KEYS[name])


def test_the_list_is_paged_with_a_cursor_and_filtered_by_status(live_server, files):
    with live_server.client("pages") as client:
        spec = spec_of(client, files)
        ids = [submit(client, spec)["id"] for _ in range(5)]
        bad = submit(client, {**spec, "data": named_upload(client, files["wrong"])})["id"]
        for job_id in [*ids, bad]:
            wait_for(client, job_id)
        newest_first = [bad, *reversed(ids)]
        pages, cursor = [], None
        while True:
            params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
            page = client.get("/v1/jobs", params=params).json()
            pages.append([job["id"] for job in page["jobs"]])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert [job_id for page in pages for job_id in page] == newest_first
        assert all(len(page) == 2 for page in pages[:-1])
        failed = client.get("/v1/jobs", params={"status": "failed"}).json()
        assert [job["id"] for job in failed["jobs"]] == [bad] and failed["next_cursor"] is None
        assert failed["jobs"][0]["error"]["title"]
        succeeded = client.get("/v1/jobs", params={"status": "succeeded", "limit": 3}).json()
        assert [job["id"] for job in succeeded["jobs"]] == newest_first[1:4]
        rest = client.get("/v1/jobs", params={"status": "succeeded", "cursor": succeeded["next_cursor"]}).json()
        assert [job["id"] for job in rest["jobs"]] == newest_first[4:]
        unknown = client.get("/v1/jobs", params={"cursor": "f" * 32})
        assert unknown.status_code == 400 and "cursor" in unknown.json()["detail"]
    with live_server.client("alice") as other:  # another key's job is no cursor
        assert other.get("/v1/jobs", params={"cursor": ids[0]}).status_code == 400


def test_a_job_view_names_its_inputs_and_times_its_phases(live_server, files):
    with live_server.client("feed") as client:
        spec = spec_of(client, files, eval={"data": named_upload(client, files["eval"])})
        job = wait_for(client, submit(client, spec)["id"])
    assert job["status"] == "succeeded", job["error"]
    assert job["revision"] > len(job["phases"])  # each phase change was a change of the job
    inputs = {name: entry["filename"] for name, entry in job["inputs"].items()}
    assert inputs == {"checkpoint": "team-model.pt", "data": "calib-16.npy", "eval.data": "eval-8.npy"}
    assert job["inputs"]["data"]["digest"] == spec["data"]
    phases = [entry["phase"] for entry in job["phases"]]
    assert phases[0] == "starting workers" and "calibrating" in phases and phases[-1] == "writing", phases
    assert "evaluating" in phases
    assert all(entry["seconds"] is not None and entry["seconds"] >= 0 for entry in job["phases"])
    total = sum(entry["seconds"] for entry in job["phases"])
    started, finished = (job[name] for name in ("started_at", "finished_at"))
    from datetime import datetime

    wall = (datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds()
    assert abs(total - wall) < 0.5, (total, wall)


def test_head_says_whether_this_key_has_a_blob(live_server):
    body = b"only carol has these bytes " + str(time.time()).encode()
    with live_server.client("carol") as owner, live_server.client("bob") as other:
        digest = upload(owner, body)
        mine = owner.head(f"/v1/blobs/{digest}")
        assert mine.status_code == 200 and mine.content == b""
        assert int(mine.headers["content-length"]) == len(body)
        assert other.head(f"/v1/blobs/{digest}").status_code == 404
        assert owner.head("/v1/blobs/sha256:" + "0" * 64).status_code == 404


def test_a_dry_run_checks_completely_and_creates_nothing(live_server, files):
    with live_server.client("feed") as client:
        spec = spec_of(client, files)
        before = client.get("/v1/jobs", params={"limit": 500}).json()["jobs"]
        valid = client.post("/v1/jobs", params={"dry_run": "true"}, json=spec)
        assert valid.status_code == 200, valid.text
        assert valid.json()["valid"] is True and valid.json()["spec"]["outputs"] == ["checkpoint"]
        assert "location" not in valid.headers
        missing = {**spec, "data": "sha256:" + "1" * 64}
        refused = client.post("/v1/jobs", params={"dry_run": "true"}, json=missing)
        assert refused.status_code == 422 and refused.json()["field"] == "data"
        wrong_model = client.post("/v1/jobs", params={"dry_run": "true"}, json={**spec, "arch": "os:system"})
        assert wrong_model.status_code in (400, 422) and "BNRECAL_MODEL_MODULES" in wrong_model.json()["detail"]
        too_small = client.post("/v1/jobs", params={"dry_run": "true"}, json={**spec, "batch_size": 0})
        assert too_small.status_code == 422
        misfit = client.post("/v1/jobs", params={"dry_run": "true"},
                             json={**spec, "model_kwargs": {"channels": 7}})  # the checkpoint does not fit
        assert misfit.status_code == 422, misfit.text
        after = client.get("/v1/jobs", params={"limit": 500}).json()["jobs"]
    assert [job["id"] for job in after] == [job["id"] for job in before]
    assert live_server.services.ledger.queued() == [] or all(
        job.tenant != _tenant("feed") for job in live_server.services.ledger.queued()
    )
