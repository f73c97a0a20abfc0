"""An architecture that cannot be built is a 422 naming ``arch`` at submission, before a job
exists, with close names suggested; one that can be built is accepted."""

from __future__ import annotations

import pytest

from tests.api.conftest import upload, write_samples
from tests.conftest import save_state
from tests.nets import mixed_net

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def blobs(live_server, tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("architectures")
    data, _ = write_samples(folder / "x.npy", 4)
    with live_server.client("carol") as client:
        return {"checkpoint": upload(client, save_state(folder / "m.pt", mixed_net())), "data": upload(client, data)}


@pytest.mark.parametrize(
    ("arch", "expected"),
    [
        ("torchvision:resnet19", "unknown torchvision model 'resnet19' (did you mean resnet18"),
        ("resnet18", "(did you mean torchvision:resnet18?)"),
        ("timm:resnet181", "unknown timm model 'resnet181' (did you mean resnet18"),
        ("tests.nets:mixd_net", "module 'tests.nets' has no attribute 'mixd_net' (arch tests.nets:mixd_net) "
                                "(did you mean mixed_net"),
        ("tests.no_such_module:net", "cannot import module 'tests.no_such_module'"),
        ("tests.nets:MARKER", "tests.nets:MARKER is not callable (it is a float)"),
    ],
)
def test_an_architecture_that_cannot_be_built_is_refused_before_a_job_exists(live_server, blobs, arch, expected):
    with live_server.client("carol") as client:
        before = client.get("/v1/jobs", params={"limit": 500}).json()["jobs"]
        response = client.post("/v1/jobs", json={"arch": arch, **blobs})
        after = client.get("/v1/jobs", params={"limit": 500}).json()["jobs"]
    assert response.status_code == 422 and response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["field"] == "arch" and expected in problem["detail"], problem
    assert len(after) == len(before)


def test_a_known_architecture_is_accepted(live_server, blobs, tmp_path):
    import torchvision

    kwargs = {"width_mult": 0.1, "num_classes": 10}  # small enough for the test server's upload cap
    checkpoint = save_state(tmp_path / "mobilenet.pt", torchvision.models.mobilenet_v2(**kwargs))
    with live_server.client("carol") as client:
        spec = {"arch": "torchvision:mobilenet_v2", "model_kwargs": kwargs, **blobs, "workers": 1}
        response = client.post("/v1/jobs", json=spec | {"checkpoint": upload(client, checkpoint)})
        assert response.status_code == 202, response.text
        client.post(f"/v1/jobs/{response.json()['id']}/cancel")  # the data does not fit resnet18: no need to run it
