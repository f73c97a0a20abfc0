"""Calibration data from arrays: npy/npz reading, memory maps, streaming, options and errors."""

from __future__ import annotations

import pickle
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset, iter_batches, read_labels
from bnrecal.errors import DatasetError, DatasetOptionError, SpecError


def test_npy_float32_is_memory_mapped_and_read_by_rows(tmp_path: Path) -> None:
    values = np.random.default_rng(0).standard_normal((50, 3, 4, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", values)
    spec = describe_dataset(tmp_path / "x.npy")
    assert (spec.kind, spec.num_samples, spec.sample_shape) == ("array", 50, (3, 4, 4))
    data = spec.open()
    batch = data.load(7, 19)
    assert batch.dtype == torch.float32 and batch.shape == (12, 3, 4, 4)
    np.testing.assert_array_equal(batch.numpy(), values[7:19])
    assert isinstance(data.memory_map, np.memmap)
    assert Path(data.memory_map.filename) == (tmp_path / "x.npy").resolve()


def test_npy_uint8_is_fed_as_float_without_scaling(tmp_path: Path) -> None:
    values = np.arange(4 * 6, dtype=np.uint8).reshape(4, 6) * 10
    np.save(tmp_path / "u.npy", values)
    batch = describe_dataset(tmp_path / "u.npy").open().load(0, 4)
    assert batch.dtype == torch.float32
    assert batch.max().item() == 230.0
    np.testing.assert_array_equal(batch.numpy(), values.astype(np.float32))


def test_npy_reading_rows_does_not_load_the_whole_array(tmp_path: Path) -> None:
    values = np.ones((2000, 1000), dtype=np.float32)  # 8 MB
    np.save(tmp_path / "big.npy", values)
    data = describe_dataset(tmp_path / "big.npy").open()
    tracemalloc.start()
    data.load(1990, 2000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000


@pytest.mark.parametrize(
    ("arrays", "chosen"),
    [({"data": 1, "x": 2, "z": 3}, "x"), ({"data": 1, "z": 3}, "data"), ({"images": 4}, "images")],
)
def test_npz_array_choice(tmp_path: Path, arrays: dict[str, int], chosen: str) -> None:
    stored = {name: np.full((3, 2), fill, np.float32) for name, fill in arrays.items()}
    np.savez(tmp_path / "a.npz", **stored)
    spec = describe_dataset(tmp_path / "a.npz")
    assert spec.layout is not None and spec.layout.array_name == chosen
    np.testing.assert_array_equal(spec.open().load(0, 3).numpy(), stored[chosen])


def test_npz_with_several_unnamed_arrays_names_them(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", inputs=np.zeros((3, 2)), targets=np.zeros((3, 2)))
    with pytest.raises(DatasetError, match="inputs, targets"):
        describe_dataset(tmp_path / "a.npz")


def test_npz_stored_member_is_memory_mapped_at_its_offset(tmp_path: Path) -> None:
    values = np.random.default_rng(1).standard_normal((40, 5)).astype(np.float32)
    np.savez(tmp_path / "s.npz", labels=np.arange(40), x=values)
    spec = describe_dataset(tmp_path / "s.npz")
    assert spec.layout is not None and spec.layout.storage == "npz-stored"
    data = spec.open()
    assert isinstance(data.memory_map, np.memmap)
    raw = (tmp_path / "s.npz").read_bytes()
    offset = spec.layout.data_offset
    assert raw[offset : offset + values.nbytes] == values.tobytes()  # the offset is the array's bytes
    np.testing.assert_array_equal(data.load(11, 33).numpy(), values[11:33])


def test_npz_compressed_member_is_streamed_by_rows(tmp_path: Path) -> None:
    values = np.random.default_rng(2).standard_normal((2000, 1000)).astype(np.float32)  # 8 MB
    np.savez_compressed(tmp_path / "c.npz", x=values)
    spec = describe_dataset(tmp_path / "c.npz")
    assert spec.layout is not None and spec.layout.storage == "npz-compressed"
    data = spec.open()
    assert data.memory_map is None
    tracemalloc.start()
    last = data.load(1990, 2000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2_000_000
    np.testing.assert_array_equal(last.numpy(), values[1990:2000])
    np.testing.assert_array_equal(data.load(3, 9).numpy(), values[3:9])  # backwards: rewinds
    np.testing.assert_array_equal(data.load(9, 10).numpy(), values[9:10])


def bomb_npz(path: Path, samples: int = 4000) -> Path:
    """The issue's file: ``np.savez_compressed`` of zeros, ~50 KB expanding ~1000:1 (49 MB)."""
    np.savez_compressed(path, x=np.zeros((samples, 3, 32, 32), dtype=np.float32))
    return path


def test_a_compressed_npz_member_over_the_compression_ratio_is_refused_as_a_bomb(tmp_path: Path) -> None:
    bomb = bomb_npz(tmp_path / "bomb.npz")
    with pytest.raises(DatasetError, match=r"bomb\.npz: compressed array x expands \d+:1.*decompression bomb"
                       r".*BNRECAL_MAX_COMPRESSION_RATIO.*np\.savez"):
        describe_dataset(bomb)
    with pytest.raises(DatasetError, match="decompression bomb"):  # the operator's ratio is the one applied
        describe_dataset(bomb, access=DataAccess(max_compression_ratio=200))
    assert describe_dataset(bomb, access=DataAccess(max_compression_ratio=5000)).num_samples == 4000


def test_a_compressed_npz_member_over_the_unpacked_bound_is_refused(tmp_path: Path) -> None:
    values = np.random.default_rng(3).standard_normal((300, 1000)).astype(np.float32)  # 1.2 MB, barely compresses
    np.savez_compressed(tmp_path / "big.npz", x=values)
    with pytest.raises(DatasetError, match=r"big\.npz: compressed array x decompresses to \d+ bytes, more than "
                       r"the 1000000 allowed \(BNRECAL_MAX_UNPACKED_BYTES\)"):
        describe_dataset(tmp_path / "big.npz", access=DataAccess(max_unpacked_bytes=1_000_000))
    assert describe_dataset(tmp_path / "big.npz", access=DataAccess(max_unpacked_bytes=2_000_000)).num_samples == 300
    np.savez(tmp_path / "stored.npz", x=values)  # a stored member is mapped, its size is the file's own
    assert describe_dataset(tmp_path / "stored.npz", access=DataAccess(max_unpacked_bytes=1_000_000)).num_samples == 300


def test_compressed_labels_larger_than_one_integer_per_sample_are_refused_unread(tmp_path: Path) -> None:
    x = np.random.default_rng(4).standard_normal((10, 3)).astype(np.float32)
    np.savez_compressed(tmp_path / "ok.npz", x=x, y=np.arange(10))
    np.testing.assert_array_equal(read_labels(describe_dataset(tmp_path / "ok.npz")), np.arange(10))
    np.savez_compressed(tmp_path / "y-bomb.npz", x=x, y=np.zeros(4_000_000, dtype=np.int64))  # 32 MB from ~30 KB
    spec = describe_dataset(tmp_path / "y-bomb.npz")
    tracemalloc.start()
    with pytest.raises(DatasetError, match=r"labels 'y' take \d+ bytes, more than one integer for each of the 10"):
        read_labels(spec)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4_000_000  # refused before decompressing it


def test_opened_arrays_survive_pickling(tmp_path: Path) -> None:
    values = np.arange(30, dtype=np.float64).reshape(10, 3)
    np.savez_compressed(tmp_path / "c.npz", x=values)
    spec = pickle.loads(pickle.dumps(describe_dataset(tmp_path / "c.npz")))
    data = spec.open()
    data.load(0, 2)
    copy = pickle.loads(pickle.dumps(data))
    np.testing.assert_array_equal(copy.load(4, 6).numpy(), values[4:6].astype(np.float32))


def test_max_samples_keeps_the_first_samples(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(20, dtype=np.float32).reshape(10, 2))
    spec = describe_dataset(tmp_path / "x.npy", ReadOptions(max_samples=4))
    assert (spec.num_samples, spec.total_samples) == (4, 10)
    data = spec.open()
    assert len(data) == 4
    np.testing.assert_array_equal(data.load(0, 4).numpy().ravel(), np.arange(8, dtype=np.float32))
    with pytest.raises(IndexError):
        data.load(3, 5)
    assert describe_dataset(tmp_path / "x.npy", ReadOptions(max_samples=99)).num_samples == 10


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "4"])
def test_invalid_max_samples_is_refused(tmp_path: Path, bad: object) -> None:
    np.save(tmp_path / "x.npy", np.zeros((3, 2), np.float32))
    with pytest.raises(DatasetOptionError, match="max_samples") as caught:
        describe_dataset(tmp_path / "x.npy", ReadOptions(max_samples=bad))  # type: ignore[arg-type]
    assert isinstance(caught.value, DatasetError) and isinstance(caught.value, SpecError)
    assert caught.value.field == "max_samples"


def test_empty_range_gives_an_empty_batch(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((5, 3, 2), np.uint8))
    empty = describe_dataset(tmp_path / "x.npy").open().load(5, 5)
    assert empty.shape == (0, 3, 2) and empty.dtype == torch.float32


@pytest.mark.parametrize(
    ("array", "match"),
    [
        (np.array([1 + 2j, 3j]).reshape(2, 1), "complex"),
        (np.array([["a"], ["b"]]), "<U1"),
        (np.arange(5, dtype=np.float32), "shape"),
        (np.float32(3.0), "shape"),
        (np.zeros((0, 4), np.float32), "no samples"),
        (np.zeros((4, 0), np.float32), "no values"),
    ],
)
def test_unusable_arrays_are_refused(tmp_path: Path, array: np.ndarray, match: str) -> None:
    np.save(tmp_path / "a.npy", array)
    with pytest.raises(DatasetError, match=match):
        describe_dataset(tmp_path / "a.npy")


def test_object_array_is_refused_without_unpickling(tmp_path: Path) -> None:
    np.save(tmp_path / "o.npy", np.array([[{"a": 1}], [None]], dtype=object), allow_pickle=True)
    with pytest.raises(DatasetError, match="object"):
        describe_dataset(tmp_path / "o.npy")


def test_corrupt_and_missing_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "garbage.npy").write_bytes(b"not an array at all" * 10)
    with pytest.raises(DatasetError, match="garbage.npy"):
        describe_dataset(tmp_path / "garbage.npy")
    np.save(tmp_path / "cut.npy", np.zeros((100, 10), np.float32))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "cut.npy").read_bytes()[:1000])
    with pytest.raises(DatasetError, match="truncated"):
        describe_dataset(tmp_path / "cut.npy")
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 broken")
    with pytest.raises(DatasetError, match="bad.npz"):
        describe_dataset(tmp_path / "bad.npz")
    with pytest.raises(DatasetError, match="not found"):
        describe_dataset(tmp_path / "absent.npy")
    (tmp_path / "table.csv").write_text("1,2\n3,4\n")
    with pytest.raises(DatasetError, match=r"unknown calibration data format 'table\.csv' \(extension \.csv\)"):
        describe_dataset(tmp_path / "table.csv")


def test_a_file_without_extension_is_recognised_by_content(tmp_path: Path) -> None:
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "x.npy", values)
    (tmp_path / "x.npy").rename(tmp_path / "blob")
    np.testing.assert_array_equal(describe_dataset(tmp_path / "blob").open().load(0, 4).numpy(), values)
    with zipfile.ZipFile(tmp_path / "npzblob", "w") as archive:
        with archive.open("data.npy", "w") as member:
            np.lib.format.write_array(member, values)
    assert describe_dataset(tmp_path / "npzblob").layout.array_name == "data"  # type: ignore[union-attr]


def test_a_stored_blob_is_named_as_uploaded_but_read_by_its_content(tmp_path: Path) -> None:
    stored = tmp_path / ("5891b5b5" * 8)  # a blob: named by its digest, no extension
    stored.write_text("1,2\n3,4\n")
    with pytest.raises(DatasetError) as caught:
        describe_dataset(stored, ReadOptions(name="calib.txt"))
    assert str(caught.value) == (
        "unknown calibration data format 'calib.txt' (extension .txt); expected a .npy or .npz file, "
        "an image folder, a .tar, .tar.gz/.tgz or .zip archive of images, WebDataset .tar shards, Parquet files, "
        "a MosaicML Streaming (MDS) folder or a manifest of shards"
    )  # a blob is never read as a manifest, whatever its upload was called
    with pytest.raises(DatasetError, match=f"format 'sha256:{stored.name}' \\(no extension\\)"):
        describe_dataset(stored, ReadOptions(name=f"sha256:{stored.name}"))  # a blob uploaded without a name
    np.save(tmp_path / "x.npy", np.zeros((0, 3), np.float32))
    (tmp_path / "x.npy").replace(stored)
    with pytest.raises(DatasetError, match=r"^calib\.npy holds no samples"):
        describe_dataset(stored, ReadOptions(name="calib.npy"))
    with zipfile.ZipFile(stored, "w") as archive:  # an archive of no images, unpacked into a folder named by digest
        archive.writestr("notes/readme.md", "no pictures here")
    with pytest.raises(DatasetError, match="no images") as caught:
        describe_dataset(stored, ReadOptions(name="photos"), DataAccess(unpack_root=tmp_path / "unpacked"))
    assert "photos" in str(caught.value) and stored.name not in str(caught.value)
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "x.npy", values)
    (tmp_path / "x.npy").replace(stored)
    # The name is only shown: .npy bytes are read as .npy.
    spec = describe_dataset(stored, ReadOptions(name="calib.txt"))
    assert spec.kind == "array" and spec.summary().source == "calib.txt"
    np.testing.assert_array_equal(spec.open().load(0, 2).numpy(), values)


def test_transform_is_refused_for_arrays(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((3, 2), np.float32))
    with pytest.raises(DatasetOptionError, match="image data only"):
        describe_dataset(tmp_path / "x.npy", ReadOptions(transform={"crop": 32}))


def test_iter_batches_reads_arrays_in_order(tmp_path: Path) -> None:
    values = np.random.default_rng(9).standard_normal((17, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", values)
    data = describe_dataset(tmp_path / "x.npy").open()
    ranges = [(0, 5), (5, 5), (12, 17)]
    batches = list(iter_batches(data, ranges, num_workers=2))
    for (start, stop), batch in zip(ranges, batches, strict=True):
        np.testing.assert_array_equal(batch.numpy(), values[start:stop])
    with pytest.raises(IndexError):
        list(iter_batches(data, [(10, 18)]))


def test_every_error_of_a_stored_blob_names_it_as_uploaded_where_raised(tmp_path: Path) -> None:
    """A blob is stored (and an archive unpacked) under its digest: each error, from describing
    it or from reading it later in a rank, calls it by the name it was uploaded with."""
    stored = tmp_path / ("a1b2c3d4" * 8)
    stored.write_bytes(b"\x93NUMPY\x09\x00")  # an .npy of an unknown format version
    with pytest.raises(DatasetError, match=r"^calib\.npy has an unsupported \.npy format version 9$"):
        describe_dataset(stored, ReadOptions(name="calib.npy"))
    stored.write_bytes(b"\x1f\x8b" + b"\x00" * 64)  # gzip magic, no tar inside
    with pytest.raises(DatasetError, match=r"^photos\.tgz is not a valid tar archive") as caught:
        describe_dataset(stored, ReadOptions(name="photos.tgz"), DataAccess(unpack_root=tmp_path / "unpacked"))
    assert stored.name not in str(caught.value)
    np.save(tmp_path / "x.npy", np.zeros((4, 3), np.float32))
    (tmp_path / "x.npy").replace(stored)
    spec = describe_dataset(stored, ReadOptions(name="calib.npy"))
    np.save(tmp_path / "x.npy", np.zeros((2, 3), np.float32))  # replaced after it was described
    (tmp_path / "x.npy").replace(stored)
    with pytest.raises(DatasetError, match=r"^calib\.npy changed since it was described"), spec.open() as data:
        data.load(0, 1)
