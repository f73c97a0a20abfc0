"""Job specs and statuses: what a submission must satisfy before it is queued."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator

import pytest
import torch
from pydantic import ValidationError

from bnrecal.service.jobserver.storage.blobs import BlobStore, FileBlobStore
from bnrecal.service.jobserver.records.spec import DataPath, JobSpec
from bnrecal.service.jobserver.jobs.submission import check_data_uri, check_submission, resolve_data_path
from bnrecal.service.jobserver.records.views import TERMINAL_STATUSES, JobStatus
from bnrecal.service.settings import Settings
from tests.nets import mixed_net
from bnrecal.errors import ArchitectureError, CheckpointError, SpecError

DIGEST = "sha256:" + "a" * 64


def spec(**fields) -> JobSpec:
    return JobSpec.model_validate({"arch": "tests.nets:mixed_net", "checkpoint": DIGEST, "data": DIGEST} | fields)


def test_terminal_statuses():
    assert {s for s in JobStatus if s.is_terminal} == {JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled}
    assert TERMINAL_STATUSES == {s for s in JobStatus if s.is_terminal}
    assert not JobStatus.queued.is_terminal and not JobStatus.running.is_terminal


def test_defaults_and_normalisation():
    job = spec(outputs=["onnx", "checkpoint", "onnx"])
    assert job.workers == 1 and job.mode == "sync" and job.device == "cpu" and job.batch_size == 32
    assert job.outputs == ["onnx", "checkpoint"]
    assert job.onnx.opset == 18 and job.onnx.dynamic_batch
    assert isinstance(spec(data={"path": "/srv/calib"}).data, DataPath)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"workers": 0}, "workers"),
        ({"batch_size": -1}, "batch_size"),
        ({"mode": "global"}, "mode"),
        ({"device": "tpu"}, "device"),
        ({"checkpoint": "sha256:xyz"}, "checkpoint"),
        ({"data": "calib.npy"}, "data"),
        ({"data": {"path": "/x", "other": 1}}, "data"),
        ({"outputs": ["checkpoint", "weights"]}, "outputs"),
        ({"onnx": {"opset": 3}}, "onnx"),
        ({"onnx": {"input_shape": [1, 0, 3]}}, "onnx"),
        ({"unknown_option": True}, "unknown_option"),
        ({"max_samples": 0}, "max_samples"),
    ],
)
def test_invalid_fields_are_named(fields, field):
    with pytest.raises(ValidationError) as info:
        spec(**fields)
    assert info.value.errors()[0]["loc"][0] == field


def _upload(store: BlobStore, tenant: str, payload: bytes) -> str:
    async def once() -> AsyncIterator[bytes]:
        yield payload

    return asyncio.run(store.ingest(tenant, once(), 1 << 20)).digest


def test_submission_needs_the_tenants_own_blobs(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    settings = Settings(data_dir=tmp_path, model_modules=["tests"])
    buffer = io.BytesIO()
    torch.save(mixed_net().state_dict(), buffer)
    checkpoint = _upload(store, "alice", buffer.getvalue())
    data = _upload(store, "alice", b"samples")
    check_submission(spec(checkpoint=checkpoint, data=data), "alice", store, settings)
    with pytest.raises(SpecError, match="checkpoint: no blob") as info:
        check_submission(spec(checkpoint=checkpoint, data=data), "bob", store, settings)
    assert info.value.field == "checkpoint"
    with pytest.raises(SpecError) as info:
        check_submission(spec(checkpoint=checkpoint, data=DIGEST), "alice", store, settings)
    assert info.value.field == "data"


def test_a_checkpoint_that_does_not_fit_is_refused_at_submission(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    settings = Settings(data_dir=tmp_path, model_modules=["tests"])
    data = _upload(store, "alice", b"samples")
    for payload, message in ((b"weights", "is corrupt"), (_legacy_checkpoint(), "shape mismatches")):
        checkpoint = _upload(store, "alice", payload)
        with pytest.raises(CheckpointError, match=message):
            check_submission(spec(checkpoint=checkpoint, data=data, model_kwargs={"channels": 7}), "alice", store, settings)


def _legacy_checkpoint() -> bytes:
    """A torch file in the pre-1.6 format, which cannot be memory-mapped."""
    buffer = io.BytesIO()
    torch.save(mixed_net().state_dict(), buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


@pytest.mark.parametrize("arch", ["os:system", "subprocess:run", "testsuite.nets:x", "builtins:eval"])
def test_architectures_outside_the_allowlist_are_refused_before_import(tmp_path, arch):
    settings = Settings(data_dir=tmp_path, model_modules=["tests"])
    with pytest.raises(ArchitectureError, match="BNRECAL_MODEL_MODULES"):
        check_submission(spec(arch=arch), "alice", FileBlobStore(tmp_path / "blobs"), settings)


def test_data_paths_only_under_the_roots(tmp_path):
    root = tmp_path / "calib"
    (root / "set").mkdir(parents=True)
    (root / "set" / "x.npy").write_bytes(b"x")
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    settings = Settings(data_dir=tmp_path, data_roots=[root])
    assert resolve_data_path(str(root / "set" / "x.npy"), settings) == (root / "set" / "x.npy").resolve()
    for path, message in [
        (str(outside), "outside"),
        (str(root / "escape"), "outside"),  # a link out of the root
        (str(root / "set" / ".." / ".." / "secret"), "outside"),
        ("set/x.npy", "absolute"),
        (str(root / "missing.npy"), "does not exist"),
    ]:
        with pytest.raises(SpecError, match=message) as info:
            resolve_data_path(path, settings)
        assert info.value.field == "data.path"
    with pytest.raises(SpecError, match="BNRECAL_DATA_ROOTS"):
        resolve_data_path(str(root / "set" / "x.npy"), Settings(data_dir=tmp_path))


def test_a_brace_pattern_of_shards_lies_under_the_roots_shard_by_shard(tmp_path):
    """Every shard a pattern names is checked like a path: under a root, no link out, existing;
    a manifest, whose lines could name anything, is refused on the server."""
    root = tmp_path / "calib"
    (root / "wds").mkdir(parents=True)
    for i in range(3):
        (root / "wds" / f"train-{i:03d}.tar").write_bytes(b"x")
    outside = tmp_path / "secret.tar"
    outside.write_bytes(b"x")
    (root / "wds" / "train-003.tar").symlink_to(outside)
    settings = Settings(data_dir=tmp_path, data_roots=[root], data_uris=["s3://team/calib"])
    pattern = str(root / "wds" / "train-{000..002}.tar")
    assert resolve_data_path(pattern, settings) == root.resolve() / "wds" / "train-{000..002}.tar"
    for path, message in [
        (str(root / "wds" / "train-{000..003}.tar"), "outside"),  # one shard links out of the root
        (str(root / "wds" / "train-{002,004}.tar"), "train-004.tar. does not exist"),
        (str(root / "{wds,x}" / "train-000.tar"), "last path component"),
        (str(root / "wds" / "list.manifest"), "does not read manifests"),
    ]:
        with pytest.raises(SpecError, match=message) as info:
            resolve_data_path(path, settings)
        assert info.value.field == "data.path"
    assert check_data_uri("s3://team/calib/train-{000..146}.tar", settings) == "s3://team/calib/train-{000..146}.tar"
    for uri, message in [
        ("s3://team/other/train-{0..9}.tar", "outside the server's allowed prefixes"),
        ("s3://team/calib/{a,../b}.tar", r"\.\. components|plain file name"),
        ("s3://team/calib/shards.txt", "does not read manifests"),
    ]:
        with pytest.raises(SpecError, match=message):
            check_data_uri(uri, settings)
