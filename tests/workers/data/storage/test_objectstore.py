"""Calibration data in object storage, read from a local moto S3 server: the same samples
in the same order as the local copy, each read fetching only its own bytes."""

from __future__ import annotations

import io
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset, read_labels
from bnrecal.workers.data.storage.objectstore import parse_data_uri, uri_allowed
from bnrecal.errors import DatasetError, SpecError

from tests.s3 import S3Server

BUCKET = "calib-data"


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def npz_bytes(compressed: bool = False, **arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buffer, **arrays)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def samples() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((50, 3, 4, 5)).astype(np.float32)


@pytest.mark.parametrize(
    "uri, reason",
    [
        ("s3://key:secret@bucket/x.npy", "credentials"),
        ("s3://bucket:9000/x.npy", "port"),
        ("s3://bucket/x.npy?versionId=1", "query"),
        ("s3://bucket/x.npy#frag", "fragment"),
        ("gs://bucket/x.npy", "not supported"),
        ("s3://Bad_Bucket/x.npy", "bucket name"),
        ("s3://bucket/a/../b.npy", ".."),
        ("/local/path.npy", "must be a URI"),
    ],
)
def test_unsafe_or_unsupported_uris_are_refused(uri: str, reason: str) -> None:
    with pytest.raises(SpecError, match="data.uri") as caught:
        parse_data_uri(uri)
    assert reason in caught.value.message


def test_allowlist_matches_buckets_folders_and_prefixes() -> None:
    allowed = ["s3://team/calib", "s3://open", "s3://shared/pre-", "s3://slash/calib/"]
    assert uri_allowed("s3://team/calib", allowed)
    assert uri_allowed("s3://team/calib/x.npy", allowed)
    assert not uri_allowed("s3://team/calibration/x.npy", allowed)  # a folder, not a string prefix
    assert not uri_allowed("s3://team/other.npy", allowed)
    assert uri_allowed("s3://open/anything/at/all.npz", allowed)
    assert not uri_allowed("s3://pre-open/x.npy", allowed)
    assert not uri_allowed("s3://shared/x.npy", allowed)
    assert not uri_allowed("s3://team/calib/x.npy", [])
    assert uri_allowed("s3://slash/calib/x.npy", allowed) and not uri_allowed("s3://slash/calibx", allowed)


@pytest.mark.parametrize("kind", ["npy", "npz", "npz-compressed"])
def test_arrays_read_the_same_rows_as_the_local_file(
    s3_server: S3Server, samples: np.ndarray, tmp_path: Path, kind: str
) -> None:
    payload = npy_bytes(samples) if kind == "npy" else npz_bytes(kind == "npz-compressed", x=samples)
    suffix = ".npy" if kind == "npy" else ".npz"
    uri = s3_server.put(BUCKET, f"arrays/{kind}{suffix}", payload)
    local = tmp_path / f"local{suffix}"
    local.write_bytes(payload)
    remote_spec = describe_dataset(uri, ReadOptions(max_samples=40), DataAccess(endpoint_url=s3_server.endpoint))
    local_spec = describe_dataset(local, ReadOptions(max_samples=40))
    assert remote_spec.layout == local_spec.layout and remote_spec.num_samples == 40
    assert replace(remote_spec.summary(), source="x") == replace(local_spec.summary(), source="x")
    with remote_spec.open() as remote, local_spec.open() as here:
        for start, stop in [(0, 7), (7, 21), (33, 40), (5, 5)]:
            np.testing.assert_array_equal(remote.load(start, stop).numpy(), here.load(start, stop).numpy())


def test_a_compressed_npz_bomb_in_object_storage_is_refused_from_its_directory(s3_server: S3Server) -> None:
    zeros = np.zeros((4000, 3, 32, 32), dtype=np.float32)  # ~50 KB expanding ~1000:1
    uri = s3_server.put(BUCKET, "arrays/bomb.npz", npz_bytes(True, x=zeros))
    with pytest.raises(DatasetError, match=r"bomb\.npz: compressed array x expands \d+:1.*BNRECAL_MAX_COMPRESSION_RATIO"):
        describe_dataset(uri, access=DataAccess(endpoint_url=s3_server.endpoint))
    assert describe_dataset(
        uri, access=DataAccess(endpoint_url=s3_server.endpoint, max_compression_ratio=5000),
    ).num_samples == 4000


@pytest.mark.parametrize("kind", ["npy", "npz"])
def test_a_row_range_fetches_only_its_own_bytes(s3_server: S3Server, kind: str) -> None:
    samples = np.random.default_rng(1).standard_normal((200, 3, 16, 16)).astype(np.float32)  # 0.8 MB
    payload = npy_bytes(samples) if kind == "npy" else npz_bytes(x=samples, y=np.arange(200))
    key = f"ranged/{kind}.{kind}"
    uri = s3_server.put(BUCKET, key, payload)
    spec = describe_dataset(uri, access=DataAccess(endpoint_url=s3_server.endpoint))
    described = s3_server.gets(f"/{BUCKET}/{key}")
    assert sum(r.sent for r in described) < 200_000 < len(payload)  # headers and zip directory only
    row = samples[0].nbytes
    with spec.open() as data:
        before = len(s3_server.gets(f"/{BUCKET}/{key}"))
        rows = data.load(10, 17)
    np.testing.assert_array_equal(rows.numpy(), samples[10:17])
    (fetch,) = s3_server.gets(f"/{BUCKET}/{key}")[before:]
    assert spec.layout is not None
    first = spec.layout.data_offset + 10 * row
    assert fetch.range == f"bytes={first}-{first + 7 * row - 1}" and fetch.sent == 7 * row


def test_npz_labels_are_read_from_object_storage(s3_server: S3Server, samples: np.ndarray) -> None:
    labels = np.arange(50) % 3
    uri = s3_server.put(BUCKET, "labelled/eval.npz", npz_bytes(x=samples, y=labels))
    spec = describe_dataset(
        uri, ReadOptions(max_samples=30, role="evaluation data"), DataAccess(endpoint_url=s3_server.endpoint),
    )
    np.testing.assert_array_equal(read_labels(spec), labels[:30])


def write_class_folders(folder: Path) -> None:
    for index, name in enumerate(["cat/b.png", "cat/a.png", "dog/c.png", "dog/.hidden.png", "dog/notes.txt"]):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".png"):
            Image.new("RGB", (9, 7), (index * 40, 10, 200)).save(folder / name)
        else:
            (folder / name).write_text("not an image")


def test_image_prefix_lists_like_the_local_folder(s3_server: S3Server, tmp_path: Path) -> None:
    folder = tmp_path / "wrapper" / "set"
    write_class_folders(folder)
    uri = s3_server.put_tree(BUCKET, "images/v1", tmp_path / "wrapper")  # a wrapper folder, as locally
    transform = {"resize": 8, "crop": 6}
    remote_spec = describe_dataset(uri, ReadOptions(transform=transform), DataAccess(endpoint_url=s3_server.endpoint))
    local_spec = describe_dataset(tmp_path / "wrapper", ReadOptions(transform=transform))
    assert remote_spec.classes == local_spec.classes == ("cat", "dog")
    assert remote_spec.part.files_digest == local_spec.part.files_digest and remote_spec.num_samples == 3
    np.testing.assert_array_equal(read_labels(remote_spec), read_labels(local_spec))
    with remote_spec.open() as remote, local_spec.open() as here:
        np.testing.assert_array_equal(remote.load(0, 3).numpy(), here.load(0, 3).numpy())
        before = len(s3_server.requests)
        remote.load(1, 2)
    fetched = [r for r in s3_server.requests[before:] if r.method == "GET"]
    assert [r.path for r in fetched] == [f"/{BUCKET}/images/v1/set/cat/b.png"]


def test_archive_is_fetched_and_unpacked_with_the_bomb_limits(s3_server: S3Server, tmp_path: Path) -> None:
    folder = tmp_path / "set"
    write_class_folders(folder)
    archive = tmp_path / "set.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="set")
    uri = s3_server.put(BUCKET, "archives/set.tar.gz", archive)
    unpack_root = tmp_path / "unpacked"
    spec = describe_dataset(
        uri,
        ReadOptions(transform={"resize": 8, "crop": 6}),
        DataAccess(endpoint_url=s3_server.endpoint, unpack_root=unpack_root),
    )
    assert spec.source == uri and spec.display_name == "set.tar.gz" and spec.remote is None
    assert Path(spec.path).is_relative_to(unpack_root) and spec.classes == ("cat", "dog") and spec.num_samples == 3
    assert not [p for p in unpack_root.iterdir() if p.name.startswith(".fetch-")]  # the download is gone
    with pytest.raises(DatasetError, match="more than the 10 an archive may unpack to"):
        describe_dataset(
            uri, access=DataAccess(endpoint_url=s3_server.endpoint, unpack_root=unpack_root, max_unpacked_bytes=10),
        )


def test_missing_objects_and_buckets_name_the_uri(s3_server: S3Server) -> None:
    s3_server.bucket(BUCKET)
    for uri in (f"s3://{BUCKET}/nothing/here.npy", "s3://no-such-bucket/x.npy"):
        with pytest.raises(DatasetError, match=f"calibration data not found: {uri}$"):
            describe_dataset(uri, access=DataAccess(endpoint_url=s3_server.endpoint))
    with pytest.raises(DatasetError, match="no images found"):
        describe_dataset(s3_server.put(BUCKET, "only-text/readme.txt", b"x").rsplit("/", 1)[0],
                         access=DataAccess(endpoint_url=s3_server.endpoint))
    with pytest.raises(DatasetError, match="unknown calibration data format"):
        describe_dataset(
            s3_server.put(BUCKET, "weird/data.bin", b"x"), access=DataAccess(endpoint_url=s3_server.endpoint),
        )


def test_an_unreachable_endpoint_fails_in_seconds_naming_the_uri() -> None:
    with pytest.raises(DatasetError, match=r"s3://calib-data/x.npy cannot be read: Could not connect"):
        describe_dataset("s3://calib-data/x.npy", access=DataAccess(endpoint_url="http://127.0.0.1:9"))


def test_the_aws_environment_endpoint_is_honoured(
    s3_server: S3Server, samples: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = s3_server.put(BUCKET, "env/x.npy", npy_bytes(samples))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    assert describe_dataset(uri).num_samples == 50
