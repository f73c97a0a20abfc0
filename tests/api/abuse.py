"""The probes an attacker with a tenant's key sent to ``bnrecal serve`` (issue 21), as data.

Each probe is one request and the answer it must get: a problem+json 4xx at submission,
or, where only running can tell, a job that fails fast with a 4xx-typed error. They are
replayed once by ``tests/api/test_abuse.py`` and over and over, beside real jobs, by
``bench/soak.py --probes``. ``Blobs`` are the tenant's valid uploads the probes build on.
"""

from __future__ import annotations

import io
import json
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class Blobs:
    """A tenant's uploads: a mixed_net checkpoint and its data, and two kinds of bad data."""

    checkpoint: str
    data: str
    bomb: str
    non_finite: str

    def spec(self, **changes: Any) -> dict[str, Any]:
        """A valid job spec on these blobs, with ``changes``."""
        return {"arch": "tests.nets:mixed_net", "checkpoint": self.checkpoint, "data": self.data, "workers": 1} | changes


@dataclass(frozen=True)
class Probe:
    """One abusive request and the answer it must get (``job_error``: the error type of a
    job that is accepted and must fail as bad input)."""

    name: str
    send: Callable[[httpx.Client, Blobs], httpx.Response]
    status: int
    field: str | None = None
    job_error: str | None = None


def bomb_npz(samples: int = 4000) -> bytes:
    """``np.savez_compressed`` of zeros: about 1000:1, the issue's file."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, x=np.zeros((samples, 3, 6, 5), dtype=np.float32))
    return buffer.getvalue()


def non_finite_npy() -> bytes:
    """Calibration data for mixed_net whose second step holds a NaN."""
    values = np.random.default_rng(0).normal(size=(16, 3, 6, 5)).astype(np.float32)
    values[9, 1, 2, 3] = np.nan
    buffer = io.BytesIO()
    np.save(buffer, values)
    return buffer.getvalue()


def upload_blobs(client: httpx.Client, checkpoint: bytes, data: bytes) -> Blobs:
    """Upload what the probes need under ``client``'s key."""
    def upload(body: bytes) -> str:
        response = client.post("/v1/blobs", content=body, headers={"Content-Type": "application/octet-stream"})
        response.raise_for_status()
        return response.json()["digest"]

    return Blobs(upload(checkpoint), upload(data), upload(bomb_npz()), upload(non_finite_npy()))


def _post_raw(body: bytes) -> Callable[[httpx.Client, Blobs], httpx.Response]:
    return lambda client, _: client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})


def _post(**changes: Any) -> Callable[[httpx.Client, Blobs], httpx.Response]:
    return lambda client, blobs: client.post("/v1/jobs", json=blobs.spec(**changes))


def _deep_json(client: httpx.Client, blobs: Blobs) -> httpx.Response:
    body = json.dumps(blobs.spec())[:-1] + ', "model_kwargs": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"
    return client.post("/v1/jobs", content=body.encode(), headers={"Content-Type": "application/json"})


def _huge_header(client: httpx.Client, blobs: Blobs) -> httpx.Response:
    return client.get("/v1/jobs", headers={"Authorization": "Bearer " + "x" * (1 << 20)})


PROBES = [
    Probe("a model of 10^7 classes", _post(arch="torchvision:resnet18", model_kwargs={"num_classes": 10**7}),
          422, "model_kwargs"),
    Probe("1024 workers", _post(workers=1024), 422, "workers"),
    Probe("cuda without GPUs", _post(device="cuda"), 422, "device"),
    Probe("workers: true", _post(workers=True), 422, "workers"),
    Probe('workers: "2"', _post(workers="2"), 422, "workers"),
    Probe("a dunder model_kwargs key", _post(model_kwargs={"__class__": 1}), 422),
    Probe("a body that is not UTF-8", _post_raw(b'{"arch": "\xff\xfe"}'), 422),
    Probe("JSON 5,000 deep", _deep_json, 422),
    Probe("a 1 MB Authorization header", _huge_header, 431),
    Probe("a 1000:1 compressed .npz", lambda c, b: c.post("/v1/jobs", json=b.spec(data=b.bomb)), 202,
          job_error="dataset"),
    Probe("NaN in the calibration data", lambda c, b: c.post("/v1/jobs", json=b.spec(data=b.non_finite, batch_size=8)),
          202, job_error="dataset"),
]


def check(probe: Probe, client: httpx.Client, blobs: Blobs, timeout_s: float = 120) -> str | None:
    """Send ``probe``; None when it got its answer, else what went wrong (one line)."""
    response = probe.send(client, blobs)
    if response.status_code != probe.status:
        return f"{probe.name}: {response.status_code} {response.text[:200]!r}, expected {probe.status}"
    if probe.status >= 400:
        if response.headers.get("content-type") != "application/problem+json":
            return f"{probe.name}: {probe.status} without problem+json"
        problem = response.json()
        if probe.field is not None and problem.get("field") != probe.field:
            return f"{probe.name}: field {problem.get('field')!r}, expected {probe.field!r}"
        return None
    job = response.json()
    deadline = time.monotonic() + timeout_s
    while job["status"] not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.2)
        job = client.get(f"/v1/jobs/{job['id']}").json()
    error = job.get("error") or {}
    if job["status"] != "failed" or not str(error.get("type", "")).endswith(f"/{probe.job_error}") \
            or not 400 <= int(error.get("status", 0)) < 500:
        return f"{probe.name}: job {job['status']} with {error}, expected failed of type {probe.job_error} (4xx)"
    return None
