"""Uploads and job specs at the front door: the streamed byte cap, unsafe checkpoints,
422s that name the field, Idempotency-Key, and server-side data paths."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from bnrecal.service.client import parse_events
from tests.api.conftest import KEYS, MAX_UPLOAD_BYTES, submit, upload, wait_for, write_samples
from tests.conftest import save_state
from tests.nets import mixed_net

pytestmark = pytest.mark.usefixtures("ray_cluster")


def tenant_files(live_server) -> list[Path]:
    return [p for p in (Path(live_server.settings.data_dir) / "blobs").rglob("*") if p.is_file()]


def test_oversize_streamed_upload_is_413_and_leaves_nothing(live_server):
    before = tenant_files(live_server)
    sent = []

    def body():
        for _ in range(48):  # 3 MiB against a 2 MiB cap, sent chunked: no Content-Length to trust
            sent.append(65536)
            yield os.urandom(65536)

    with live_server.client("carol") as client:
        response = client.post("/v1/blobs", content=body())
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/problem+json"
    assert "BNRECAL_MAX_UPLOAD_BYTES" in response.json()["detail"]
    assert tenant_files(live_server) == before  # nothing stored, nothing left in staging
    assert sum(sent) > MAX_UPLOAD_BYTES


def test_declared_oversize_is_refused_and_the_cap_itself_accepted(live_server):
    with live_server.client("carol") as client:
        refused = client.post("/v1/blobs", content=b"x" * (MAX_UPLOAD_BYTES + 1))
        assert refused.status_code == 413
        accepted = client.post("/v1/blobs", content=b"y" * MAX_UPLOAD_BYTES)
        assert accepted.status_code == 201 and accepted.json()["size"] == MAX_UPLOAD_BYTES
        assert accepted.headers["location"] == f"/v1/blobs/{accepted.json()['digest']}"


class RunsCode:
    """Unpickling this would run a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_a_checkpoint_that_would_run_code_is_refused_and_does_not_run(live_server, tmp_path, writer):
    marker = tmp_path / f"pwned-{writer}"
    payload = {"state_dict": mixed_net().state_dict(), "extra": RunsCode(marker)}
    checkpoint = tmp_path / "evil.pt"
    if writer == "torch.save":
        torch.save(payload, checkpoint)
    else:
        checkpoint.write_bytes(pickle.dumps(payload))
    data, _ = write_samples(tmp_path / "x.npy", 4)
    with live_server.client("carol") as client:
        spec = {"arch": "tests.nets:mixed_net", "checkpoint": upload(client, checkpoint), "data": upload(client, data)}
        jobs_before = client.get("/v1/jobs").json()["jobs"]
        response = client.post("/v1/jobs", json=spec)  # refused at submission, by the model check
        assert client.get("/v1/jobs").json()["jobs"] == jobs_before
    problem = response.json()
    assert response.status_code == 422 and problem["type"].endswith("/checkpoint")
    assert "unpickle" in problem["detail"] or "weights only" in problem["detail"]
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"workers": 0}, "workers"),
        ({"batch_size": "many"}, "batch_size"),
        ({"mode": "global"}, "mode"),
        ({"data": "calib.npy"}, "data"),
        ({"onnx": {"opset": 2}}, "onnx.opset"),
        ({"outputs": ["weights"]}, "outputs.0"),
        ({"retries": 3}, "retries"),
        ({"checkpoint": None}, "checkpoint"),
    ],
)
def test_invalid_spec_is_422_naming_the_field(live_server, change, field):
    spec = {"arch": "tests.nets:mixed_net", "checkpoint": "sha256:" + "1" * 64, "data": "sha256:" + "2" * 64}
    with live_server.client("carol") as client:
        response = client.post("/v1/jobs", json=spec | change)
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["field"] == field and field in problem["detail"]
    assert set(problem) >= {"type", "title", "status", "detail"}


def test_an_oversize_json_body_is_413(live_server):
    spec = {"arch": "tests.nets:mixed_net", "checkpoint": "sha256:" + "1" * 64, "data": "sha256:" + "2" * 64}
    with live_server.client("carol") as client:
        response = client.post("/v1/jobs", json=spec | {"model_kwargs": {"blob": "x" * (2 << 20)}})
    assert response.status_code == 413 and response.headers["content-type"] == "application/problem+json"


UNKNOWN_FORMAT = (
    "unknown {role} format {name} ({extension}); expected a .npy or .npz file, an image folder, "
    "a .tar, .tar.gz/.tgz or .zip archive of images, WebDataset .tar shards, Parquet files, a MosaicML Streaming (MDS) folder or a manifest of shards"
)


def test_errors_name_the_files_as_uploaded_not_their_digests(live_server, tmp_path):
    from bnrecal.service.client import BnrecalClient

    good = save_state(tmp_path / "good.pt", mixed_net())
    whole = good.read_bytes()
    (tmp_path / "model.pt").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "calib.txt").write_text("1,2\n3,4\n")
    samples, _ = write_samples(tmp_path / "x.npy", 4)
    with BnrecalClient(live_server.url, api_key=KEYS["carol"]) as remote:
        text = remote.upload(tmp_path / "calib.txt")
        half = remote.upload(tmp_path / "model.pt").digest
        checkpoint, data = remote.upload(good).digest, remote.upload(samples).digest
    assert text.filename == "calib.txt"
    base = {"arch": "tests.nets:mixed_net", "checkpoint": checkpoint, "data": data}
    with live_server.client("carol") as client:
        unnamed = upload(client, b"text uploaded without a name")
        named = client.post("/v1/blobs", params={"filename": "C:\\fakepath\\notes.md"}, content=b"notes")
        assert named.status_code == 201 and named.json()["filename"] == "notes.md"  # only the last component
        too_long = client.post("/v1/blobs", params={"filename": "x" * 256}, content=b"notes")
        assert too_long.status_code == 422 and too_long.json()["field"] == "query filename"
        cut = client.post("/v1/jobs", json=base | {"checkpoint": half})  # refused at submission
        specs = {
            "data": base | {"data": text.digest},
            "eval": base | {"eval": {"data": text.digest}},
            "unnamed": base | {"data": unnamed},
        }
        jobs = {case: submit(client, spec)["id"] for case, spec in specs.items()}
        errors = {case: wait_for(client, job_id)["error"] for case, job_id in jobs.items()}
    assert errors["data"]["detail"] == UNKNOWN_FORMAT.format(
        role="calibration data", name="'calib.txt'", extension="extension .txt"
    )
    assert errors["data"]["type"].endswith("/dataset") and errors["data"]["status"] == 422
    assert cut.status_code == 422 and cut.json()["type"].endswith("/checkpoint")
    assert cut.json()["detail"] == "checkpoint 'model.pt' is truncated or not a torch/safetensors file"
    assert errors["eval"]["detail"].startswith("unknown evaluation data format 'calib.txt' (extension .txt)")
    # a blob uploaded without a name is called by the digest the spec gave, not the stored file's bare hex
    assert errors["unnamed"]["detail"] == UNKNOWN_FORMAT.format(
        role="calibration data", name=f"'{unnamed}'", extension="no extension"
    )


@pytest.mark.parametrize(
    ("body", "where"),
    [(b'{"arch": ', "line 1 column 10"), (b'{\n  "arch": "x",\n}', "line 3 column 1")],
)
def test_a_body_that_is_not_json_says_where_it_breaks_and_names_no_field(live_server, body, where):
    with live_server.client("carol") as client:
        response = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422 and response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["detail"].startswith("the request body is not valid JSON: ")
    assert problem["detail"].endswith(f" at {where}") and "\n" not in problem["detail"]
    assert problem["field"] is None and problem["errors"] == []
    # a real field error still names the field path, nested ones with dots
    spec = {"arch": "tests.nets:mixed_net", "checkpoint": "sha256:" + "1" * 64, "data": "sha256:" + "2" * 64}
    with live_server.client("carol") as client:
        nested = client.post("/v1/jobs", json=spec | {"eval": {"data": 5}}).json()
    assert nested["field"] == "eval.data" and nested["errors"][0]["field"] == "eval.data"


def test_malformed_json_and_disallowed_arch_are_422(live_server):
    with live_server.client("carol") as client:
        broken = client.post("/v1/jobs", content=b'{"arch": ', headers={"Content-Type": "application/json"})
        assert broken.status_code == 422 and broken.headers["content-type"] == "application/problem+json"
        spec = {"arch": "os:system", "checkpoint": "sha256:" + "1" * 64, "data": "sha256:" + "2" * 64}
        refused = client.post("/v1/jobs", json=spec)
    assert refused.status_code == 422 and "BNRECAL_MODEL_MODULES" in refused.json()["detail"]


@pytest.fixture(scope="module")
def carols_blobs(live_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    checkpoint = save_state(folder / "m.pt", mixed_net())
    data, _ = write_samples(folder / "x.npy", 5)
    with live_server.client("carol") as client:
        return {"arch": "tests.nets:mixed_net", "checkpoint": upload(client, checkpoint), "data": upload(client, data)}


@pytest.fixture(scope="module")
def carols_job(live_server, carols_blobs):
    with live_server.client("carol") as client:
        return wait_for(client, submit(client, carols_blobs, **{"Idempotency-Key": "retry-1"})["id"])


def test_idempotency_key_returns_the_same_job(live_server, carols_blobs, carols_job):
    assert carols_job["status"] == "succeeded", carols_job["error"]
    with live_server.client("carol") as client:
        retry = client.post("/v1/jobs", json=carols_blobs, headers={"Idempotency-Key": "retry-1"})
        assert retry.status_code == 202 and retry.json()["id"] == carols_job["id"]
        assert retry.json()["status"] == "succeeded"  # the same job, not a new run
        assert retry.headers["location"] == f"/v1/jobs/{carols_job['id']}"
        assert retry.headers["idempotent-replayed"] == "true"
        other = client.post("/v1/jobs", json=carols_blobs | {"batch_size": 2}, headers={"Idempotency-Key": "retry-1"})
        assert other.status_code == 409 and other.headers["content-type"] == "application/problem+json"
        with_key = [j for j in client.get("/v1/jobs").json()["jobs"] if j["spec"] == carols_job["spec"]]
        assert [j["id"] for j in with_key] == [carols_job["id"]]


def test_server_side_data_only_under_the_data_roots(live_server, carols_blobs, tmp_path):
    inside, _ = write_samples(live_server.data_root / "calib.npy", 5)
    outside, _ = write_samples(tmp_path / "private.npy", 5)
    link = live_server.data_root / "sneaky.npy"
    link.symlink_to(outside)
    with live_server.client("carol") as client:
        for path in (outside, link, live_server.data_root / ".." / "private.npy"):
            response = client.post("/v1/jobs", json=carols_blobs | {"data": {"path": str(path)}})
            assert response.status_code == 422 and response.json()["field"] == "data.path", path
        job = submit(client, carols_blobs | {"data": {"path": str(inside)}})
        done = wait_for(client, job["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["report"]["samples"] == 5


def test_shards_on_the_server_uploaded_or_under_the_data_roots(live_server, carols_blobs, tmp_path):
    """An uploaded tar of shards, an uploaded tar of a MosaicML Streaming folder and a brace
    pattern under a data root calibrate like the folder of the same photos; a manifest is
    refused at submission, naming the field."""
    import tarfile

    from tests.shards import folder_order, photos, write_folder, write_tar_shards
    from tests.streaming_writer import MdsSet, write_mds

    items = photos(12, size=24)
    shards = write_tar_shards(live_server.data_root / "wds", folder_order(items), 5)
    write_folder(live_server.data_root / "photos", items)
    packed = tmp_path / "shards.tar"
    with tarfile.open(packed, "w") as tar:
        for shard in shards:
            tar.add(shard, arcname=shard.name)
    (mds,) = write_mds(MdsSet(tmp_path / "mds", folder_order(items), "bytes", size_limit=4_000, compression="zstd"))
    packed_mds = tmp_path / "mds.tar"
    with tarfile.open(packed_mds, "w") as tar:
        tar.add(mds, arcname=".")  # as ``tar -C mds -cf mds.tar .``
    (live_server.data_root / "wds" / "list.manifest").write_text("\n".join(p.name for p in shards))
    options = {"transform": {"resize": 8, "crop": 6}, "order": "given"}
    with live_server.client("carol") as client:
        refused = client.post("/v1/jobs", json=carols_blobs | {"data": {"path": str(live_server.data_root / "wds" / "list.manifest")}})
        assert refused.status_code == 422 and refused.json()["field"] == "data.path"
        assert "manifest" in refused.json()["detail"]
        jobs = [
            submit(client, carols_blobs | options | {"data": data})
            for data in (
                upload(client, packed), {"path": str(live_server.data_root / "wds" / "train-{000000..000002}.tar")},
                upload(client, packed_mds), {"path": str(live_server.data_root / "photos")},
            )
        ]
        done = [wait_for(client, job["id"]) for job in jobs]
    assert [d["status"] for d in done] == ["succeeded"] * 4, [d["error"] for d in done]
    assert [d["report"]["dataset"]["kind"] for d in done] == ["shards", "shards", "shards", "images"]
    layers = [d["report"]["layers"] for d in done]
    assert layers[0] == layers[1] == layers[2] == layers[3]  # the same samples in the same order: the same statistics


def test_unknown_artifact_and_job_are_404(live_server, carols_job):
    with live_server.client("carol") as client:
        assert client.get(f"/v1/jobs/{carols_job['id']}/artifacts/weights").status_code == 404
        assert client.get(f"/v1/jobs/{carols_job['id']}/artifacts/onnx").status_code == 404  # not asked for
        assert client.get("/v1/jobs/does-not-exist").status_code == 404
        assert client.get("/v1/nowhere").json()["status"] == 404


def write_images(folder: Path, count: int, seed: int) -> Path:
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    for index in range(count):
        pixels = (torch.rand(10, 12, 3, generator=generator) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / f"img{index:02d}.png")
    return folder


@pytest.mark.slow  # two more jobs
def test_image_folders_submitted_from_the_shell_as_archives(live_server, tmp_path, capsys):
    from bnrecal.service.cli import main

    checkpoint = save_state(tmp_path / "m.pt", mixed_net())
    for run, count in enumerate((5, 7)):  # two different archives: each unpacked on its own
        images = tmp_path / f"images{run}"
        images.mkdir()
        write_images(images, count, seed=run)
        report = tmp_path / f"report{run}.json"
        main([
            "submit", "--server", live_server.url, "--api-key", KEYS["carol"], "--arch", "tests.nets:mixed_net",
            "--checkpoint", str(checkpoint), "--data", str(images), "--transform", '{"resize": 8, "crop": 6}',
            "--batch-size", "4", "--out", str(tmp_path / f"out{run}.pt"), "--report", str(report),
        ])
        summary = json.loads(report.read_text())
        assert summary["samples"] == count and summary["dataset"]["kind"] == "images"
        assert summary["dataset"]["sample_shape"] == [3, 6, 6]
    assert "recalibrated 5 BN layers on 7 samples" in capsys.readouterr().err


def test_a_job_evaluates_before_and_after_and_streams_the_phase(live_server, carols_blobs, tmp_path):
    _, samples = write_samples(tmp_path / "unused.npy", 9, seed=4)
    labels = torch.arange(9) % 4  # mixed_net has 4 outputs
    np.savez(tmp_path / "eval.npz", x=samples.numpy(), y=labels.numpy())
    with live_server.client("carol") as client:
        missing = client.post("/v1/jobs", json=carols_blobs | {"eval": {"data": "sha256:" + "1" * 64}})
        assert missing.status_code == 422 and missing.json()["field"] == "eval.data"
        outside = client.post("/v1/jobs", json=carols_blobs | {"eval": {"data": {"path": str(tmp_path)}}})
        assert outside.status_code == 422 and outside.json()["field"] == "eval.data.path"
        spec = carols_blobs | {"eval": {"data": upload(client, tmp_path / "eval.npz"), "max_samples": 8}}
        job = submit(client, spec)
        with client.stream("GET", f"/v1/jobs/{job['id']}/events") as response:
            events = list(parse_events(response.iter_lines()))
        done = client.get(f"/v1/jobs/{job['id']}").json()
        html = client.get(f"/v1/jobs/{job['id']}/artifacts/report.html").text
    assert done["status"] == "succeeded", done["error"]
    evaluation = done["report"]["evaluation"]
    assert evaluation["samples"] == 8 and evaluation["labelled"] and set(evaluation["before"]) == {"top1", "cross_entropy"}
    assert 0 <= evaluation["prediction_change"] <= 1 and evaluation["kl_divergence"] >= 0
    assert done["spec"]["eval"]["max_samples"] == 8
    phases = {event.data["progress"]["phase"] for event in events}
    assert "writing" in phases and phases <= {None, "starting workers", "calibrating", "evaluating", "writing"}
    assert 'id="evaluation-table"' in html
