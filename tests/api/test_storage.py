"""Storage over HTTP on real servers: DELETE of jobs and blobs, the tenant quota (413), a
full disk (507), and the collector running over and over (in the server and as a second
process would, on its own ledger connection) while real jobs start and finish."""

from __future__ import annotations

import errno
import hashlib
import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from bnrecal.api.app import create_app
from bnrecal.service.cli.main import main
from bnrecal.service.jobserver.storage.blobs import FileBlobStore
from bnrecal.service.jobserver.ledger import Ledger, sqlite_url
from bnrecal.service.jobserver.server import tenant_of_key
from bnrecal.service.jobserver.storage.collection import StorageCollector
from bnrecal.service.settings import Settings
from tests.api.conftest import LiveServer, free_port, submit, upload, wait_for, write_samples
from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net, mixed_net, perturbed

pytestmark = pytest.mark.usefixtures("ray_cluster")

KEY = "storage-key"
OTHER_KEY = "storage-other-key"
QUOTA = 3 * 1024 * 1024
JOBS = 4


@contextmanager
def serve(root: Path, **overrides: Any) -> Iterator[LiveServer]:
    """A real uvicorn server of its own data dir, on the session's Ray."""
    settings = Settings(data_dir=root / "data", model_modules=["tests"], api_keys=[KEY, OTHER_KEY],
                        collective_timeout_s=120, **overrides)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn-storage", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the storage test server did not start"
        time.sleep(0.05)
    try:
        yield LiveServer(f"http://127.0.0.1:{server.config.port}", settings, app, root)
    finally:
        server.should_exit = True
        thread.join(60)


def client_of(live: LiveServer, key: str = KEY) -> httpx.Client:
    return httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture(scope="module")
def quota_server(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with serve(tmp_path_factory.mktemp("storage-quota"), tenant_quota_bytes=QUOTA, gc_interval_s=0) as live:
        yield live


def job_spec(checkpoint: str, data: str, **extra: Any) -> dict[str, Any]:
    return {"arch": "tests.nets:mixed_net", "checkpoint": checkpoint, "data": data, "batch_size": 8, **extra}


def problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    return response.json()


def test_delete_jobs_and_blobs(quota_server, tmp_path):
    with client_of(quota_server) as client:
        unused = upload(client, b"nobody uses me")
        assert client.delete(f"/v1/blobs/{unused}").status_code == 204
        assert client.head(f"/v1/blobs/{unused}").status_code == 404
        problem(client.delete(f"/v1/blobs/{unused}"), 404)
        problem(client.delete("/v1/jobs/" + "0" * 32), 404)

        torch.manual_seed(0)
        checkpoint = upload(client, save_state(tmp_path / "m.pt", perturbed(mixed_net())))
        data = upload(client, write_samples(tmp_path / "x.npy", 24)[0])
        done = wait_for(client, submit(client, job_spec(checkpoint, data))["id"])
        assert done["status"] == "succeeded", done["error"]
        artifacts = {name: artifact["digest"] for name, artifact in done["artifacts"].items()}
        assert client.get(f"/v1/jobs/{done['id']}/artifacts/checkpoint").status_code == 200
        with client_of(quota_server, OTHER_KEY) as other:  # another key's job and blobs are not found
            problem(other.delete(f"/v1/jobs/{done['id']}"), 404)
            problem(other.delete(f"/v1/blobs/{checkpoint}"), 404)

        samples = torch.randn(40, 4)
        samples[9, 0] = MARKER  # the third step hangs: the job stays running until cancelled
        hanging = {"arch": "tests.nets:marker_net", "model_kwargs": {"action": "hang"}, "batch_size": 4, "order": "given",
                   "checkpoint": upload(client, save_state(tmp_path / "h.pt", marker_net())),
                   "data": upload(client, save_array(tmp_path / "h.npy", samples))}
        running = wait_for(client, submit(client, hanging)["id"], ("running",), progressed=True)
        conflict = problem(client.delete(f"/v1/jobs/{running['id']}"), 409)
        assert "cancel it first" in conflict["detail"]
        conflict = problem(client.delete(f"/v1/blobs/{hanging['data']}"), 409)
        assert running["id"] in conflict["detail"]
        assert client.post(f"/v1/jobs/{running['id']}/cancel").status_code == 202
        assert wait_for(client, running["id"])["status"] == "cancelled"
        assert client.delete(f"/v1/blobs/{hanging['data']}").status_code == 204  # no live job uses it now
        assert bnrecal("delete", running["id"], "--server", quota_server.url, "--api-key", KEY) == 0
        problem(client.get(f"/v1/jobs/{running['id']}"), 404)
        assert bnrecal("delete", running["id"], "--server", quota_server.url, "--api-key", KEY) == 2  # gone

        assert client.delete(f"/v1/jobs/{done['id']}").status_code == 204
        problem(client.get(f"/v1/jobs/{done['id']}"), 404)
        problem(client.delete(f"/v1/jobs/{done['id']}"), 404)
        for digest in artifacts.values():  # its artifacts are freed, its inputs stay
            assert client.head(f"/v1/blobs/{digest}").status_code == 404
        assert client.head(f"/v1/blobs/{checkpoint}").status_code == 200
        assert client.head(f"/v1/blobs/{data}").status_code == 200


def test_an_upload_past_the_quota_is_413_naming_the_setting(quota_server):
    with client_of(quota_server) as client:
        for digest in [blob.digest for blob in quota_server.services.blobs.stored(tenant_of_key(KEY))]:
            client.delete(f"/v1/blobs/{digest}")  # start from an empty tenant (jobs deleted above)
        first = upload(client, b"a" * (2 * 1024 * 1024))
        over = problem(client.post("/v1/blobs", content=b"b" * (1024 * 1024 + 1)), 413)
        assert "BNRECAL_TENANT_QUOTA_BYTES" in over["detail"] and str(QUOTA) in over["detail"]
        assert over["title"] == "Storage quota exceeded"

        def streamed() -> Iterator[bytes]:  # no Content-Length: refused on the bytes received
            for _ in range(3):
                yield b"c" * (512 * 1024)

        over = problem(client.post("/v1/blobs", content=streamed()), 413)
        assert "BNRECAL_TENANT_QUOTA_BYTES" in over["detail"]
        assert quota_server.services.blobs.staging_files() == []
        assert upload(client, b"d" * 1000)  # what fits still fits
        assert client.delete(f"/v1/blobs/{first}").status_code == 204  # deleting frees room
        assert upload(client, b"b" * (1024 * 1024 + 1))


def test_a_full_disk_mid_upload_is_507_and_keeps_nothing(quota_server):
    blobs = quota_server.services.blobs
    with client_of(quota_server) as client:
        kept = upload(client, b"stored before the disk filled")
        before = {digest for tenant in blobs.tenants() for digest in (b.digest for b in blobs.stored(tenant))}

        def fill_disk(handle: io.BufferedWriter, digest: Any, chunks: list[bytes]) -> None:
            handle.write(chunks[0][: len(chunks[0]) // 2])  # part of it lands, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

        original, blobs.write_chunks = blobs.write_chunks, fill_disk
        try:
            full = problem(client.post("/v1/blobs", content=b"e" * (1536 * 1024)), 507)
        finally:
            blobs.write_chunks = original
        assert full["title"] == "Insufficient storage" and "disk is full" in full["detail"]
        assert blobs.staging_files() == []
        assert {digest for tenant in blobs.tenants() for digest in (b.digest for b in blobs.stored(tenant))} == before
        assert client.get(f"/v1/blobs/{kept}").content == b"stored before the disk filled"
        assert upload(client, b"e" * 1000)  # and writing works again


@pytest.mark.slow  # four real jobs one after another: ~30 s idle, ~2 min on a busy 2-core machine
def test_collection_while_jobs_start_and_finish_never_takes_what_they_need(tmp_path):
    """The collector runs every 50 ms in the server and in a loop on its own ledger connection
    (as ``bnrecal gc`` would), with blob and unpack retention of seconds, while four jobs
    sharing a checkpoint start and finish: every job succeeds, its artifacts download intact,
    what retained jobs need survives, an unreferenced blob goes."""
    torch.manual_seed(1)
    model = perturbed(mixed_net())
    # A generous placement timeout: on a busy 2-core machine starting a rank's process can take minutes.
    with serve(tmp_path, gc_interval_s=0.05, blob_retention_s=3, unpack_retention_s=0,
               placement_timeout_s=600) as live:
        data_dir = Path(live.settings.data_dir)
        ledger = Ledger(sqlite_url(data_dir))
        outside = StorageCollector(live.services.settings, ledger, FileBlobStore(data_dir / "blobs"))
        stop, passes, failures = threading.Event(), [0], []

        def collect_forever() -> None:
            while not stop.is_set():
                try:
                    outside.collect()
                    passes[0] += 1
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    failures.append(exc)
                time.sleep(0.02)

        gc_thread = threading.Thread(target=collect_forever, daemon=True)
        gc_thread.start()
        try:
            with client_of(live) as client:
                decoy = upload(client, b"uploaded and never used")
                jobs, inputs = [], set()
                for index in range(JOBS):
                    checkpoint = upload(client, save_state(tmp_path / "m.pt", model))  # the same bytes each time
                    data = upload(client, write_samples(tmp_path / f"x{index}.npy", 16 + index, seed=index)[0])
                    inputs.update((checkpoint, data))
                    jobs.append(submit(client, job_spec(checkpoint, data, workers=1 + index % 2))["id"])
                    if index == 1:  # the later jobs start while the first ones run or finish
                        wait_for(client, jobs[0], ("running", "succeeded"), timeout=600)
                finished = [wait_for(client, job_id, timeout=600) for job_id in jobs]
                assert [job["status"] for job in finished] == ["succeeded"] * JOBS, [j["error"] for j in finished]
                for job in finished:
                    check_artifacts(client, job)
                time.sleep(4)  # past the blob retention, with more collections
                assert client.head(f"/v1/blobs/{decoy}").status_code == 404
                for digest in inputs:  # retained jobs' inputs stay
                    assert client.head(f"/v1/blobs/{digest}").status_code == 200, digest
                for job in finished:  # retained jobs and their artifacts stay
                    assert client.get(f"/v1/jobs/{job['id']}").status_code == 200
                    check_artifacts(client, job)
        finally:
            stop.set()
            gc_thread.join(30)
        assert not failures, failures
        assert passes[0] > 10

        # Past the job retention everything goes: the jobs, their artifacts, then their inputs.
        report = outside.collect(now=time.time() + live.settings.job_retention_s + 3600)
        ledger.close()
        assert report.count("job") == JOBS
        with client_of(live) as client:
            for job in finished:
                assert client.get(f"/v1/jobs/{job['id']}").status_code == 404
                for artifact in job["artifacts"].values():
                    assert client.head(f"/v1/blobs/{artifact['digest']}").status_code == 404
            for digest in inputs:
                assert client.head(f"/v1/blobs/{digest}").status_code == 404


def bnrecal(*args: str) -> int:
    """Run the command line in this process; its exit code."""
    try:
        main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def check_artifacts(client: httpx.Client, job: dict[str, Any]) -> None:
    """Every artifact downloads with the bytes its digest names; the checkpoint loads."""
    for name, artifact in job["artifacts"].items():
        response = client.get(f"/v1/jobs/{job['id']}/artifacts/{name}")
        assert response.status_code == 200, response.text
        assert "sha256:" + hashlib.sha256(response.content).hexdigest() == artifact["digest"]
    state = torch.load(io.BytesIO(client.get(f"/v1/jobs/{job['id']}/artifacts/checkpoint").content),
                       weights_only=True)
    assert any(key.endswith("running_mean") for key in state)
