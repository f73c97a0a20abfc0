"""A real uvicorn server on loopback, in this process, on the session's real local Ray.

Each test module talks to it with its own API key, so every module is its own tenant
and sees only its own jobs and blobs.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from fastapi import FastAPI

from bnrecal.api.app import create_app
from bnrecal.service.cli.remote import HTTP_PROTOCOL
from bnrecal.service.jobserver.server import Services
from bnrecal.service.settings import Settings
from tests.nets import mixed_net, perturbed

KEYS = {name: f"test-key-{name}" for name in ("alice", "bob", "carol", "load", "fuzz", "web", "cli", "s3", "programs", "abuse", "errors", "python", "feed", "feed2", "pages", "weblist", "submit", "int8", "sampling", "sweeps", "empty", "openvino")}
MAX_UPLOAD_BYTES = 2 * 1024 * 1024
TERMINAL = ("succeeded", "failed", "cancelled")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    settings: Settings
    app: FastAPI
    data_root: Path

    @property
    def services(self) -> Services:
        return self.app.state.services

    def client(self, key: str | None, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {KEYS[key]}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kwargs)


@pytest.fixture(scope="session")
def live_server(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("api-server")
    data_root = root / "server-data"
    data_root.mkdir()
    settings = Settings(
        data_dir=root / "data",
        model_modules=["tests"],
        api_keys=list(KEYS.values()),
        max_upload_bytes=MAX_UPLOAD_BYTES,
        collective_timeout_s=120,
        data_roots=[data_root],
    )
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=HTTP_PROTOCOL))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    yield LiveServer(f"http://127.0.0.1:{port}", settings, app, data_root)
    server.should_exit = True
    thread.join(60)


@pytest.fixture(scope="session")
def small_model() -> torch.nn.Module:
    """``mixed_net`` with BN statistics that do not fit the data of :func:`write_samples`."""
    torch.manual_seed(0)
    return perturbed(mixed_net())


@pytest.fixture(scope="session")
def stale_checkpoint(small_model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Save ``small_model``'s stale checkpoint as ``name`` in a folder of its own and return
    the path: the name is what the server, the CLI and the page show for the upload."""

    def save(name: str = "model.pt") -> Path:
        path = tmp_path_factory.mktemp("stale") / name
        torch.save(small_model.state_dict(), path)
        return path

    return save


def write_samples(path: Path, count: int, seed: int = 0) -> tuple[Path, torch.Tensor]:
    """Calibration samples for ``mixed_net`` as .npy."""
    generator = torch.Generator().manual_seed(seed)
    samples = torch.randn(count, 3, 6, 5, generator=generator) * 1.5 + 0.3
    np.save(path, samples.numpy())
    return path, samples


def upload(client: httpx.Client, payload: bytes | Path, filename: str | None = None) -> str:
    """Upload bytes or a file as a blob (named ``filename`` where given); its digest."""
    body = payload.read_bytes() if isinstance(payload, Path) else payload
    params = {"filename": filename} if filename is not None else None
    response = client.post("/v1/blobs", params=params, content=body, headers={"Content-Type": "application/octet-stream"})
    assert response.status_code == 201, response.text
    return response.json()["digest"]


def named_upload(client: httpx.Client, path: Path) -> str:
    """Upload a file under its own name, the name the server then shows for it; its digest."""
    return upload(client, path, path.name)


def submit(client: httpx.Client, spec: dict[str, Any], **headers: str) -> dict[str, Any]:
    response = client.post("/v1/jobs", json=spec, headers=headers)
    assert response.status_code == 202, response.text
    assert response.headers["location"] == f"/v1/jobs/{response.json()['id']}"
    return response.json()


def wait_for(client: httpx.Client, job_id: str, statuses: tuple[str, ...] = TERMINAL, timeout: float = 120,
             progressed: bool = False) -> dict[str, Any]:
    """Poll a job until it is in one of ``statuses`` (and, if asked, has processed samples)."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses and (not progressed or job["progress"]["samples_done"] > 0):
            return job
        if job["status"] in TERMINAL and job["status"] not in statuses:
            raise AssertionError(f"job ended {job['status']}: {job['error']}")
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {job['status']} after {timeout} s")
        time.sleep(0.1)
