"""API keys: 401 without a valid key; each key its own tenant (others' jobs and blobs are 404)."""

from __future__ import annotations

import pytest

from tests.api.conftest import submit, upload, wait_for, write_samples
from tests.conftest import save_state
from tests.nets import mixed_net

pytestmark = pytest.mark.usefixtures("ray_cluster")

V1_CALLS = [
    ("POST", "/v1/blobs"),
    ("GET", "/v1/blobs/sha256:" + "0" * 64),
    ("HEAD", "/v1/blobs/sha256:" + "0" * 64),
    ("DELETE", "/v1/blobs/sha256:" + "0" * 64),
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/abc"),
    ("GET", "/v1/jobs/abc/events"),
    ("POST", "/v1/jobs/abc/cancel"),
    ("DELETE", "/v1/jobs/abc"),
    ("GET", "/v1/jobs/abc/artifacts/checkpoint"),
]


@pytest.mark.parametrize(("method", "path"), V1_CALLS)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", "Basic dGVzdDp0ZXN0", "Bearer"])
def test_every_v1_call_needs_a_valid_key(live_server, method, path, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    with live_server.client(None) as client:
        response = client.request(method, path, headers=headers, content=b"{}")
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    if method != "HEAD":
        assert response.headers["content-type"] == "application/problem+json"
        problem = response.json()
        assert problem["status"] == 401 and problem["title"] == "Unauthorized" and problem["detail"]


def test_operations_endpoints_need_no_key(live_server):
    with live_server.client(None) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert client.get("/openapi.json").status_code == 200


@pytest.fixture(scope="module")
def alices_job(live_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("auth")
    checkpoint = save_state(folder / "m.pt", mixed_net())
    data, _ = write_samples(folder / "x.npy", 6)
    with live_server.client("alice") as alice:
        spec = {"arch": "tests.nets:mixed_net", "checkpoint": upload(alice, checkpoint), "data": upload(alice, data)}
        job = wait_for(alice, submit(alice, spec)["id"])
    assert job["status"] == "succeeded", job["error"]
    return job, checkpoint


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/jobs/{job}"),
        ("GET", "/v1/jobs/{job}/events"),
        ("POST", "/v1/jobs/{job}/cancel"),
        ("GET", "/v1/jobs/{job}/artifacts/checkpoint"),
        ("GET", "/v1/jobs/{job}/artifacts/report"),
        ("GET", "/v1/blobs/{checkpoint}"),
        ("HEAD", "/v1/blobs/{checkpoint}"),
        ("GET", "/v1/blobs/{artifact}"),
    ],
)
def test_another_keys_job_and_blobs_are_not_found(live_server, alices_job, method, path):
    job, _ = alices_job
    url = path.format(
        job=job["id"], checkpoint=job["spec"]["checkpoint"], artifact=job["artifacts"]["checkpoint"]["digest"]
    )
    with live_server.client("alice") as alice:
        assert alice.request(method, url).status_code in (200, 409)  # alice's own (cancel: already finished)
    with live_server.client("bob") as bob:
        response = bob.request(method, url)
    assert response.status_code == 404
    if method != "HEAD":
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["status"] == 404


def test_lists_and_submissions_stay_within_the_tenant(live_server, alices_job):
    job, checkpoint = alices_job
    with live_server.client("bob") as bob:
        assert job["id"] not in [j["id"] for j in bob.get("/v1/jobs").json()["jobs"]]
        refused = bob.post("/v1/jobs", json=job["spec"])
        assert refused.status_code == 422 and refused.json()["field"] == "checkpoint"
        # the same bytes uploaded by bob are his own blob, under the same digest
        assert upload(bob, checkpoint) == job["spec"]["checkpoint"]
        assert bob.get(f"/v1/blobs/{job['spec']['checkpoint']}").content == checkpoint.read_bytes()
    with live_server.client("alice") as alice:
        assert job["id"] in [j["id"] for j in alice.get("/v1/jobs").json()["jobs"]]
