"""Shards as calibration data (docs/data.md): WebDataset tars, Parquet and ``save_to_disk``
Arrow give the same samples in the same order as the same photos in a folder; the seeded
order is over samples, its global batches the same for any K; bad shards fail naming the
shard and the member; a tar is told apart from an archive of images."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset, read_labels
from bnrecal.errors import DatasetError
from bnrecal.workers.ranks.sharding import rank_ranges

from tests.shards import folder_order, photos, write_folder, write_parquet, write_save_to_disk, write_tar_shards

TRANSFORM = {"resize": 24, "crop": 24}


@pytest.fixture(scope="module")
def formats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """150 photos as a folder with class folders, and in its order as every shard format."""
    root = tmp_path_factory.mktemp("formats")
    items = photos(150, size=32)
    ordered = folder_order(items)
    write_folder(root / "folder", items)
    tars = write_tar_shards(root / "wds", ordered, 40)
    write_tar_shards(root / "wdsgz", ordered, 40, gz=True)
    write_parquet(root / "pq", ordered, 70, row_group=25)
    write_save_to_disk(root / "arrow", ordered, batch=30)
    (root / "list.manifest").write_text("# shards\n" + "\n".join(f"wds/{p.name}" for p in tars) + "\n")
    return {
        "folder": root / "folder", "tar": root / "wds", "tar.gz": root / "wdsgz",
        "pattern": str(root / "wds" / "train-{000000..000003}.tar"), "list": [str(p) for p in tars],
        "manifest": root / "list.manifest", "parquet": root / "pq", "parquet file": root / "pq" / "data" / "train-00000-of-00003.parquet",
        "arrow": root / "arrow", "root": root,
    }


def read_all(source: object, cache: Path, **options: object) -> tuple[torch.Tensor, np.ndarray | None, object]:
    spec = describe_dataset(source, ReadOptions(transform=TRANSFORM, **options), DataAccess(unpack_root=cache / "unpacked"))
    with spec.open() as data:
        return data.load(0, len(data)), read_labels(spec), spec


@pytest.mark.parametrize("order", ["given", "shuffled"])
@pytest.mark.parametrize("fmt", ["tar", "tar.gz", "pattern", "list", "manifest", "parquet", "arrow"])
def test_every_format_gives_the_folders_samples_in_its_order(formats, fmt, order, tmp_path):
    expected, labels, _ = read_all(formats["folder"], tmp_path, order=order, seed=5, max_samples=120)
    found, found_labels, spec = read_all(formats[fmt], tmp_path, order=order, seed=5, max_samples=120)
    assert spec.kind == "shards" and spec.num_samples == 120 and spec.total_samples == 150
    assert torch.equal(found, expected)  # the same JPEG bytes decode the same: same statistics, same top-1
    assert np.array_equal(found_labels, labels)


def test_one_parquet_file_is_its_rows(formats, tmp_path):
    found, labels, spec = read_all(formats["parquet file"], tmp_path)
    everything, all_labels, _ = read_all(formats["parquet"], tmp_path)
    assert spec.summary().format == "parquet" and spec.num_samples == 70
    assert torch.equal(found, everything[:70]) and np.array_equal(labels, all_labels[:70])


@pytest.mark.parametrize("fmt", ["tar", "tar.gz", "parquet"])
def test_global_batches_are_the_same_for_any_number_of_ranks(formats, fmt, tmp_path):
    """Rank k reads only its part of each step; the parts joined are the K=1 step, for K=1, 2, 4."""
    spec = describe_dataset(
        formats[fmt],
        ReadOptions(transform=TRANSFORM, order="shuffled", seed=1),
        DataAccess(unpack_root=tmp_path / "u"),
    )
    batch = 16
    steps: dict[int, list[torch.Tensor]] = {}
    for world in (1, 2, 4):
        parts = []
        for rank in range(world):
            with spec.open() as data:
                ranges = rank_ranges(spec.num_samples, batch, world, rank)
                data.plan_reads(ranges)  # as iter_batches does: a costly read reads ahead
                parts.append([data.load(a, b) for a, b in ranges])
        steps[world] = [torch.cat([p[j] for p in parts]) for j in range(len(parts[0]))]
    for world in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(steps[1], steps[world]))
    assert sum(len(s) for s in steps[1]) == 150


def test_shard_index_is_cached_by_mtime(formats, tmp_path):
    shards = sorted(Path(formats["tar"]).glob("*.tar"))
    copy = tmp_path / "one.tar"
    copy.write_bytes(shards[0].read_bytes())
    first = describe_dataset(copy, ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u"))
    cached = list((tmp_path / "shard-index").glob("*.npz"))
    assert len(cached) == 1 and first.num_samples == 40
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new version: indexed again
    describe_dataset(copy, ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u"))
    assert len(list((tmp_path / "shard-index").glob("*.npz"))) == 2


def test_a_shard_rewritten_after_it_was_indexed_fails_instead_of_reading_other_bytes(tmp_path):
    items = photos(12, size=32)
    (path,) = write_tar_shards(tmp_path / "s", items, 12)
    spec = describe_dataset(
        path, ReadOptions(transform=TRANSFORM, order="given"), DataAccess(unpack_root=tmp_path / "u"),
    )
    write_tar_shards(tmp_path / "s", [(n, d + b"\0" * 700, label) for n, d, label in items], 12)
    with spec.open() as data, pytest.raises(DatasetError, match=r"train-000000.tar.*(changed|corrupt)"):
        data.load(0, 12)


def test_truncated_shard_names_the_shard_and_the_member(tmp_path):
    (path,) = write_tar_shards(tmp_path / "s", photos(10, size=32), 10)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DatasetError, match=r"shard train-000000.tar is truncated or corrupt after member 0000\d\d_\d\.\w+"):
        describe_dataset(path, ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u"))
    assert not list((tmp_path / "shard-index").glob("*.npz"))  # nothing written for a bad shard


def test_truncated_gzip_shard_names_the_shard(tmp_path):
    (path,) = write_tar_shards(tmp_path / "s", photos(10, size=32), 10, gz=True)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) * 2 // 3])
    with pytest.raises(DatasetError, match=r"shard train-000000.tar.gz is truncated or corrupt"):
        describe_dataset(path, ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u"))


def test_corrupt_member_names_the_shard_and_the_member(tmp_path):
    items = photos(6, size=32)
    items[4] = (items[4][0], b"\xff\xd8 not a jpeg" + bytes(300), items[4][2])
    (path,) = write_tar_shards(tmp_path / "s", items, 6)
    spec = describe_dataset(
        path, ReadOptions(transform=TRANSFORM, order="given"), DataAccess(unpack_root=tmp_path / "u"),
    )
    with spec.open() as data:
        data.load(0, 4)
        with pytest.raises(DatasetError, match=r"cannot decode image train-000000.tar:000004_1.jpg"):
            data.load(2, 6)


def test_corrupt_parquet_cell_names_the_file_and_row(tmp_path):
    items = photos(6, size=32)
    items[3] = (items[3][0], b"garbage", items[3][2])
    (path,) = write_parquet(tmp_path, items, 6)
    spec = describe_dataset(
        path, ReadOptions(transform=TRANSFORM, order="given"), DataAccess(unpack_root=tmp_path / "u"),
    )
    with spec.open() as data, pytest.raises(DatasetError, match=r"train-00000-of-00001.parquet:row 3"):
        data.load(0, 6)


def test_evaluation_shards_without_labels_name_what_is_missing(tmp_path):
    items = photos(8, size=32)
    tars = write_tar_shards(tmp_path / "t", items, 8, labels=False)
    spec = describe_dataset(
        tars[0], ReadOptions(transform=TRANSFORM, role="evaluation data"), DataAccess(unpack_root=tmp_path / "u"),
    )
    with pytest.raises(DatasetError, match=r"evaluation data: shard train-000000.tar has no labels: no 000000_0.cls"):
        read_labels(spec)
    (parquet,) = write_parquet(tmp_path / "p", items, 8, labels=False)
    spec = describe_dataset(parquet, ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u"))
    with pytest.raises(DatasetError, match=r"has no label column 'label' \(columns: image\)"):
        read_labels(spec)


def test_parquet_columns_by_option_or_the_only_bytes_column(tmp_path):
    items = photos(8, size=32)
    (binary,) = write_parquet(tmp_path / "b", items, 8, binary=True, image_column="jpg")
    expected, _, _ = read_all(write_folder(tmp_path / "f", items, class_folders=False), tmp_path, order="given")
    found, labels, spec = read_all(binary, tmp_path, order="given")  # no 'image': the one bytes column
    assert spec.shards.image_column == "jpg" and torch.equal(found, expected)
    assert labels.tolist() == [label for _, _, label in items]
    with pytest.raises(DatasetError, match=r"has no image column 'picture' \(columns: jpg, label\)"):
        describe_dataset(binary, ReadOptions(image_column="picture"), DataAccess(unpack_root=tmp_path / "u"))
    spec = describe_dataset(
        binary, ReadOptions(image_column="jpg", label_column="klass"), DataAccess(unpack_root=tmp_path / "u"),
    )
    with pytest.raises(DatasetError, match=r"no label column 'klass' \(columns: jpg, label\); set label_column to its"):
        read_labels(spec)


def test_a_folder_of_several_splits_is_refused(tmp_path):
    items = photos(4, size=32)
    write_tar_shards(tmp_path / "d", items, 4, prefix="train")
    write_tar_shards(tmp_path / "d", items, 4, prefix="test")
    with pytest.raises(DatasetError, match=r"several splits \(test, train\)"):
        describe_dataset(tmp_path / "d", access=DataAccess(unpack_root=tmp_path / "u"))


def test_npy_samples_are_fed_as_they_are(tmp_path):
    rows = np.random.default_rng(0).normal(size=(9, 3, 5, 5)).astype(np.float32)
    path = tmp_path / "arrays.tar"
    with tarfile.open(path, "w") as tar:
        for i, row in enumerate(rows):
            buffer = io.BytesIO()
            np.save(buffer, row)
            info = tarfile.TarInfo(f"s{i:03d}.npy")
            info.size = len(buffer.getvalue())
            tar.addfile(info, io.BytesIO(buffer.getvalue()))
    spec = describe_dataset(path, ReadOptions(order="given"), DataAccess(unpack_root=tmp_path / "u"))
    assert spec.sample_shape == (3, 5, 5) and spec.transform is None
    with spec.open() as data:
        assert torch.equal(data.load(0, 9), torch.from_numpy(rows))


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_an_archive_of_images_is_still_unpacked(tmp_path):
    """A tar of NAME.jpg files (flat or in class folders; two images may share a name's stem)
    is an image archive, as before."""
    items = photos(6, size=32)
    flat = _tar(tmp_path / "flat.tar", {f"{n}.jpg": d for n, d, _ in items} | {f"{items[0][0]}.png": items[1][1]})
    classes = _tar(tmp_path / "classes.tar", {f"c{label}/{n}.jpg": d for n, d, label in items})
    for archive, count in ((flat, 7), (classes, 6)):
        spec = describe_dataset(archive, access=DataAccess(unpack_root=tmp_path / "u"))
        assert spec.kind == "images" and spec.num_samples == count
    assert describe_dataset(classes, access=DataAccess(unpack_root=tmp_path / "u")).classes == ("c0", "c1", "c2")


def test_a_webdataset_tar_is_told_by_its_keys(tmp_path):
    """Members grouped by key (an image beside KEY.json, without any .cls) make a shard."""
    items = photos(6, size=32)
    (shard,) = write_tar_shards(tmp_path / "s", items, 6, labels=False)
    blob = tmp_path / "sha256-upload"  # an upload is stored without its extension
    blob.write_bytes(shard.read_bytes())
    spec = describe_dataset(
        blob, ReadOptions(transform=TRANSFORM, name="mine.tar"), DataAccess(unpack_root=tmp_path / "u"),
    )
    assert spec.kind == "shards" and spec.num_samples == 6 and spec.display_name == "mine.tar"
    assert not (tmp_path / "u").exists()  # streamed, never unpacked


def test_an_uploaded_tar_of_shards_is_read_in_place(formats, tmp_path):
    shards = sorted(Path(formats["tar.gz"]).glob("*.tar.gz"))
    blob = _tar(tmp_path / "blob", {f"shards/{p.name}": p.read_bytes() for p in reversed(shards)})
    found, labels, spec = read_all(blob, tmp_path, order="given")
    expected, expected_labels, _ = read_all(formats["folder"], tmp_path, order="given")
    assert spec.kind == "shards" and len(spec.shards.shards) == 4
    assert torch.equal(found, expected) and np.array_equal(labels, expected_labels)
    assert not (tmp_path / "unpacked").exists()
    packed = tmp_path / "packed.tar.gz"
    with tarfile.open(packed, "w:gz") as tar:
        tar.add(shards[0], arcname=shards[0].name)
    with pytest.raises(DatasetError, match=r"compressed tar of shards.*plain \.tar"):
        describe_dataset(packed, access=DataAccess(unpack_root=tmp_path / "u"))


def test_a_brace_pattern_naming_a_missing_shard_fails_naming_it(formats, tmp_path):
    pattern = str(Path(formats["tar"]) / "train-{000000..000009}.tar")
    with pytest.raises(DatasetError, match=r"shard train-000004.tar of train-\{000000..000009\}.tar not found"):
        describe_dataset(pattern, access=DataAccess(unpack_root=tmp_path / "u"))
    with pytest.raises(DatasetError, match=r"last path component"):
        describe_dataset(str(Path(formats["tar"]) / "{a,b}" / "x.tar"), access=DataAccess(unpack_root=tmp_path / "u"))


def test_dataloader_workers_read_ahead_only_their_own_steps(formats, tmp_path):
    """With DataLoader workers each reads ahead the steps it decodes: the batches are the same."""
    from bnrecal.workers.data import iter_batches

    spec = describe_dataset(
        formats["tar.gz"], ReadOptions(transform=TRANSFORM, order="shuffled"), DataAccess(unpack_root=tmp_path / "u"),
    )
    ranges = rank_ranges(spec.num_samples, 12, 2, 0)
    with spec.open() as data:
        alone = list(iter_batches(data, ranges))
    with spec.open() as data:
        workers = list(iter_batches(data, ranges, num_workers=2))
    assert len(alone) == len(workers) == len(ranges)
    assert all(torch.equal(a, b) for a, b in zip(alone, workers))


def test_a_tar_of_parquet_files_is_read_in_place(formats, tmp_path):
    files = sorted(Path(formats["parquet"]).rglob("*.parquet"))
    blob = _tar(tmp_path / "blob", {p.name: p.read_bytes() for p in files})
    found, labels, spec = read_all(blob, tmp_path, order="shuffled", seed=9)
    expected, expected_labels, _ = read_all(formats["folder"], tmp_path, order="shuffled", seed=9)
    assert spec.summary().format == "parquet" and len(spec.shards.shards) == 3
    assert torch.equal(found, expected) and np.array_equal(labels, expected_labels)


def test_listing_ranges_continue_the_last_keys_number():
    from bnrecal.workers.data.shards.listing import _cuts_after

    assert _cuts_after("laion/part-000999.tar", 3) == ["laion/part-001999.tar", "laion/part-002999.tar", "laion/part-003999.tar"]
    assert _cuts_after("x/99500.parquet", 5) == []  # the next would need another digit: one range to the end
    assert _cuts_after("x/readme", 5) == []
