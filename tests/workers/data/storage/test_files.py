"""Where the bytes live (``workers.data.storage.files.Place``): a local file and the same bytes
in moto's S3 server give the same ranges and files, and a file that changed since it was
described (a short read) or is missing fails naming it. The readers read through it alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bnrecal.workers.data.formats.arrays import ArrayData
from bnrecal.workers.data.formats.npy_layout import describe_npy
from bnrecal.workers.data.formats.images import ImageData
from bnrecal.workers.data.formats.transform import resolve_transform
from bnrecal.workers.data.storage.files import Place
from bnrecal.errors import DatasetError

from tests.s3 import S3Server

BUCKET = "places"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "files"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(bytes(range(256)) * 4)
    (root / "sub" / "b.bin").write_bytes(b"second file")
    return root


def test_a_local_file_and_its_object_give_the_same_ranges_and_files(s3_server: S3Server, folder: Path) -> None:
    s3_server.bucket(BUCKET)
    prefix = s3_server.put_tree(BUCKET, "tree", folder)
    ranges = [(0, 10), (300, 301), (1000, 1024)]
    here, there = Place(str(folder / "a.bin")), Place(f"{prefix}/a.bin", s3_server.endpoint)
    assert there.remote is not None and here.remote is None
    assert here.read_ranges(ranges) == there.read_ranges(ranges) == [(bytes(range(256)) * 4)[a:b] for a, b in ranges]
    assert here.read_ranges(ranges[:1]) == there.read_ranges(ranges[:1])
    names = ["sub/b.bin", "a.bin"]
    assert Place(str(folder)).read_files(names) == Place(prefix, s3_server.endpoint).read_files(names)
    assert Place(str(folder)).read_files(names)[0] == b"second file"
    with here.open() as local, there.open() as remote:
        assert local.read() == remote.read()


def test_a_short_read_or_a_missing_file_fails_naming_it(s3_server: S3Server, folder: Path) -> None:
    s3_server.bucket(BUCKET)
    uri = s3_server.put(BUCKET, "short.bin", b"12345")
    for place in (Place(str(folder / "sub" / "b.bin")), Place(uri, s3_server.endpoint)):
        with pytest.raises(DatasetError, match="changed since it was described"):
            place.read_ranges([(0, 4096)])
    with pytest.raises(DatasetError, match="cannot read image missing.png"):
        Place(str(folder)).read_files(["missing.png"])
    with pytest.raises(DatasetError, match="not found"):
        Place(f"s3://{BUCKET}/nothing", s3_server.endpoint).read_files(["missing.png"])


def test_one_reader_per_format_reads_a_folder_and_a_prefix_alike(s3_server: S3Server, tmp_path: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(3)
    array = rng.standard_normal((12, 3, 4, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", array)
    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(images / f"{i}.png")
    s3_server.bucket(BUCKET)
    uri = s3_server.put(BUCKET, "x.npy", tmp_path / "x.npy")
    prefix = s3_server.put_tree(BUCKET, "images", images)
    layout = describe_npy(tmp_path / "x.npy")
    order = np.array([7, 2, 11, 0])
    local = ArrayData(Place(str(tmp_path / "x.npy")), layout, 4, order)
    remote = ArrayData(Place(uri, s3_server.endpoint), layout, 4, order)
    assert type(local) is type(remote) and remote.memory_map is None and local.memory_map is not None
    np.testing.assert_array_equal(local.load(0, 4).numpy(), remote.load(0, 4).numpy())
    np.testing.assert_array_equal(remote.load(0, 4).numpy(), array[order])
    transform = resolve_transform({"resize": 16, "crop": 16})
    names = [f"{i}.png" for i in range(3)]
    here, there = ImageData(Place(str(images)), names, transform), ImageData(Place(prefix, s3_server.endpoint), names, transform)
    assert here.encoded(0, 3) == there.encoded(0, 3)
    assert here.load(0, 3).equal(there.load(0, 3))
