"""Nothing damaged is ever served (a real server on the session's Ray): bytes of a stored data
blob, a checkpoint blob and an artifact flipped on disk are found when read; the download is
cut off before it completes, ``HEAD`` answers 404 so clients upload again, a job on the blob
fails at once naming it, and the next upload of the right bytes heals it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from bnrecal.service.client import BnrecalClient
from bnrecal.service.jobserver.server import tenant_of_key
from bnrecal.errors import RunError
from tests.api.conftest import LiveServer, submit, upload, wait_for, write_samples
from tests.api.test_storage import KEY, client_of, job_spec, problem, serve
from tests.conftest import save_state
from tests.nets import mixed_net, perturbed

pytestmark = pytest.mark.usefixtures("ray_cluster")

CORRUPT = "https://bnrecal.dev/problems/corrupt-blob"


@pytest.fixture(scope="module")
def live(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory):
    with serve(tmp_path_factory.mktemp("integrity"), gc_interval_s=0, scrub_interval_s=0) as server:
        yield server


def stored_file(live: LiveServer, digest: str) -> Path:
    return live.services.blobs.path(tenant_of_key(KEY), digest)


def flip(file: Path, offset: int) -> None:
    """Flip one byte in place, as a failing disk would: same name, same size."""
    with open(file, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x5A]))


def download_is_cut_off(client: httpx.Client, path: str, size: int) -> None:
    """The response starts (200, its length) but ends before its body does."""
    received = 0
    with pytest.raises(httpx.HTTPError):  # RemoteProtocolError: the peer closed mid-body
        with client.stream("GET", path) as response:
            assert response.status_code == 200 and int(response.headers["content-length"]) == size
            for chunk in response.iter_raw():
                received += len(chunk)
    assert received < size


def corrupt_count(client: httpx.Client, found_by: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'bnrecal_corrupt_blobs_total{{found_by="{found_by}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_damaged_data_blob_is_never_served_fails_its_job_and_is_healed_by_an_upload(live, tmp_path):
    with client_of(live) as client:
        torch.manual_seed(0)
        checkpoint = upload(client, save_state(tmp_path / "m.pt", perturbed(mixed_net())))
        good = write_samples(tmp_path / "x.npy", 48)[0].read_bytes()
        response = client.post("/v1/blobs?filename=calib.npy", content=good)
        data = response.json()["digest"]
        flip(stored_file(live, data), len(good) - 200)  # a sample's bytes: the header still reads

        download_is_cut_off(client, f"/v1/blobs/{data}", len(good))
        assert client.head(f"/v1/blobs/{data}").status_code == 404  # quarantined: clients upload again
        assert corrupt_count(client, "download") == 1

        again = client.post("/v1/blobs?filename=calib.npy", content=good)
        assert again.status_code == 201 and again.json()["digest"] == data
        assert client.get(f"/v1/blobs/{data}").content == good  # healed

        flip(stored_file(live, data), len(good) - 200)  # damaged again, found by the job this time
        failed = wait_for(client, submit(client, job_spec(checkpoint, data))["id"])
        assert failed["status"] == "failed" and failed["error"]["type"] == CORRUPT
        assert failed["error"]["field"] == "data" and failed["error"]["status"] == 422
        assert f"blob 'calib.npy' ({data}) is corrupt" in failed["error"]["detail"]
        assert "upload the file again" in failed["error"]["detail"]
        assert failed["phases"] == [] or failed["progress"]["samples_done"] == 0  # failed before any sample
        assert client.head(f"/v1/blobs/{data}").status_code == 404

        upload(client, good)
        done = wait_for(client, submit(client, job_spec(checkpoint, data))["id"])
        assert done["status"] == "succeeded", done["error"]


def test_a_damaged_checkpoint_is_refused_as_corrupt_never_run(live, tmp_path):
    with client_of(live) as client:
        torch.manual_seed(1)
        model_file = save_state(tmp_path / "m.pt", perturbed(mixed_net()))
        checkpoint = upload(client, model_file)
        data = upload(client, write_samples(tmp_path / "x.npy", 16)[0])
        flip(stored_file(live, checkpoint), model_file.stat().st_size // 2)
        response = client.post("/v1/jobs", json=job_spec(checkpoint, data))
        if response.status_code == 202:  # the header still read: the job finds it before it runs
            error = wait_for(client, response.json()["id"])["error"]
        else:  # the submission's checkpoint check could not read it: hashed, found corrupt
            error = problem(response, 422)
        assert error["type"] == CORRUPT and error["field"] == "checkpoint" and checkpoint in error["detail"]
        assert client.head(f"/v1/blobs/{checkpoint}").status_code == 404


def test_a_damaged_artifact_download_is_cut_off(live, tmp_path):
    with client_of(live) as client:
        torch.manual_seed(2)
        checkpoint = upload(client, save_state(tmp_path / "m.pt", perturbed(mixed_net())))
        data = upload(client, write_samples(tmp_path / "x.npy", 16)[0])
        done = wait_for(client, submit(client, job_spec(checkpoint, data))["id"])
        assert done["status"] == "succeeded", done["error"]
        artifact = done["artifacts"]["checkpoint"]
        path = f"/v1/jobs/{done['id']}/artifacts/checkpoint"
        intact = client.get(path)
        assert intact.headers["etag"] == f'"{artifact["digest"]}"' and len(intact.content) == artifact["size"]
        flip(stored_file(live, artifact["digest"]), artifact["size"] - 10)
        with BnrecalClient(live.url, KEY) as api, pytest.raises(RunError, match="was cut off"):
            api.download(done["id"], "checkpoint", tmp_path / "out" / "recalibrated.pt")
        assert not (tmp_path / "out" / "recalibrated.pt").exists()  # nothing written
        assert client.head(f"/v1/blobs/{artifact['digest']}").status_code == 404
        upload(client, intact.content)  # the same bytes again: stored again
        flip(stored_file(live, artifact["digest"]), artifact["size"] - 10)
        download_is_cut_off(client, path, artifact["size"])
        assert client.head(f"/v1/blobs/{artifact['digest']}").status_code == 404
        assert problem(client.get(path), 404)

        report = done["artifacts"]["report"]
        flip(stored_file(live, report["digest"]), 5)
        ranged = client.get(f"/v1/jobs/{done['id']}/artifacts/report", headers={"Range": "bytes=0-99"})
        assert problem(ranged, 404) and "corrupt" in ranged.json()["detail"]  # a range is hashed whole first
