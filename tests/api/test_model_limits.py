"""What a job spec can make the API process allocate: nothing. The model is checked on
the meta device against the checkpoint's header at submission."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.api.conftest import upload
from tests.conftest import save_state
from tests.nets import far_from_zero_net

pytestmark = pytest.mark.usefixtures("ray_cluster")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:  # the server runs in this process
        return int(statm.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def blobs(live_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("model-limits")
    np.save(folder / "x.npy", np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32))
    with live_server.client("alice") as client:
        return {
            "checkpoint": upload(client, save_state(folder / "m.pt", far_from_zero_net(3))),
            "data": upload(client, folder / "x.npy"),
        }


def test_ten_million_classes_are_refused_at_submission_with_the_server_unchanged(live_server, blobs):
    spec = {"arch": "torchvision:resnet18", "model_kwargs": {"num_classes": 10**7}, **blobs}
    with live_server.client("alice") as client:
        jobs_before = client.get("/v1/jobs").json()["jobs"]
        # The first refusal may import torchvision into the server (seconds and ~160 MB, once):
        # the second is the refusal's own time and memory.
        assert client.post("/v1/jobs", json=spec).status_code == 422
        before = resident_bytes()
        started = time.perf_counter()
        response = client.post("/v1/jobs", json=spec)
        elapsed = time.perf_counter() - started
        grown = resident_bytes() - before
        assert response.status_code == 422 and response.headers["content-type"] == "application/problem+json"
        problem = response.json()
        assert problem["field"] == "model_kwargs" and "BNRECAL_MAX_MODEL_BYTES" in problem["detail"]
        assert elapsed < 1.0, elapsed
        assert grown < 64 * 2**20, grown  # the model itself would be 19 GiB
        assert client.get("/v1/jobs").json()["jobs"] == jobs_before  # no job was made


def test_a_checkpoint_that_does_not_fit_the_kwargs_is_refused_at_submission(live_server, blobs):
    spec = {"arch": "tests.nets:far_from_zero_net", "model_kwargs": {"features": 5}, **blobs}
    with live_server.client("alice") as client:
        response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422
    problem = response.json()
    assert "bn.weight (3,) vs model (5,)" in problem["detail"], problem
