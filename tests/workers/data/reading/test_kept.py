"""What a rank keeps of the samples it decoded (workers.data.reading.kept): a kept sample reads back
as the very floats a fresh decode gives, whatever held it (memory, the spill file); the
budgets hold; a full disk keeps nothing more and fails nothing; a scope's release drops
its samples and its spill file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bnrecal.workers.data import ReadOptions, describe_dataset, iter_batches, ship_dataset
from bnrecal.workers.data.reading.kept import DecodedStore, KeepDecoded, KeptCounts, KeptData, open_kept
from tests.disks import mounted_tmpfs
from tests.shards import folder_order, photos, write_folder, write_tar_shards

TRANSFORM = {"resize": 20, "crop": 16}
SAMPLE_BYTES = 3 * 16 * 16  # a uint8 crop


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    items = photos(24, size=32)
    root = tmp_path_factory.mktemp("kept")
    write_folder(root / "photos", items)
    write_tar_shards(root / "shards", folder_order(items), 7)
    return root


def kept(spec, store: DecodedStore, memory: int, disk: int = 0, spill_root: Path | None = None, opened=None) -> KeptData:
    keep = KeepDecoded("job", "calibration", memory, disk, str(spill_root) if spill_root else None)
    data = KeptData(opened if opened is not None else spec.open(), store.scope(keep), "calibration")
    return data


def read(data, ranges, workers=0) -> list[torch.Tensor]:
    return list(iter_batches(data, ranges, num_workers=workers))


RANGES = [(0, 5), (5, 10), (10, 17), (17, 24)]


@pytest.mark.parametrize("source", ["photos", "shards"])
def test_kept_samples_read_back_bit_for_bit(folder, source):
    """A second pass reads from memory and gives exactly the first pass's floats, which are
    the plain dataset's; nothing is decoded twice."""
    spec = describe_dataset(folder / source, ReadOptions(transform=TRANSFORM))
    plain = read(spec.open(), RANGES)
    store = DecodedStore()
    data = kept(spec, store, memory=1 << 30)
    first, second = read(data, RANGES), read(data, RANGES)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(plain, first, second))
    assert all(batch.dtype == torch.float32 for batch in second)
    counts = store.release("job")
    assert counts == KeptCounts(decoded=24, reused=24, memory_bytes=24 * SAMPLE_BYTES, disk_bytes=0, not_kept=0)


def test_a_pass_may_not_change_what_is_kept(folder):
    """The batch a pass gets is its own: writing into it leaves the kept samples as they were."""
    spec = describe_dataset(folder / "photos", ReadOptions(transform=TRANSFORM))
    data = kept(spec, DecodedStore(), memory=1 << 30)
    first = read(data, RANGES)
    expected = [batch.clone() for batch in first]
    for batch in read(data, RANGES):
        batch.mul_(0)
    assert all(torch.equal(a, b) for a, b in zip(expected, read(data, RANGES)))


def test_other_ranges_over_the_same_samples_are_served_from_what_is_kept(folder):
    """A later pass with another batch size (the INT8 range pass on fewer samples) reads the
    samples kept by the statistics' batches."""
    spec = describe_dataset(folder / "photos", ReadOptions(transform=TRANSFORM))
    store = DecodedStore()
    data = kept(spec, store, memory=1 << 30)
    read(data, RANGES)
    other = [(0, 8), (8, 16), (16, 20)]
    assert all(torch.equal(a, b) for a, b in zip(read(data, other), read(spec.open(), other)))
    assert store.release("job").decoded == 24


def test_beyond_the_memory_budget_samples_spill_to_disk_and_read_back_exactly(folder, tmp_path):
    spec = describe_dataset(folder / "photos", ReadOptions(transform=TRANSFORM))
    store = DecodedStore()
    data = kept(spec, store, memory=10 * SAMPLE_BYTES, disk=1 << 30, spill_root=tmp_path)
    first = read(data, RANGES)
    spilled = list(tmp_path.iterdir())
    assert len(spilled) == 1 and (spilled[0] / "samples.bin").stat().st_size == 14 * SAMPLE_BYTES
    assert all(torch.equal(a, b) for a, b in zip(first, read(data, RANGES)))
    counts = store.release("job")
    assert (counts.memory_bytes, counts.disk_bytes, counts.decoded, counts.reused) == (10 * SAMPLE_BYTES, 14 * SAMPLE_BYTES, 24, 24)
    assert list(tmp_path.iterdir()) == []  # the release removed the spill file


def test_past_both_budgets_a_sample_is_decoded_again(folder, tmp_path):
    spec = describe_dataset(folder / "photos", ReadOptions(transform=TRANSFORM))
    store = DecodedStore()
    data = kept(spec, store, memory=5 * SAMPLE_BYTES, disk=5 * SAMPLE_BYTES, spill_root=tmp_path)
    first = read(data, RANGES)
    assert all(torch.equal(a, b) for a, b in zip(first, read(data, RANGES)))
    counts = store.release("job")
    assert (counts.decoded, counts.reused) == (24 + 14, 10)  # the two first ranges were kept
    assert counts.not_kept == 28


def test_a_full_disk_keeps_nothing_more_and_fails_nothing(folder, tmp_path):
    """A spill file on a disk that fills up: the pass goes on, decoding what it could not keep."""
    spec = describe_dataset(folder / "photos", ReadOptions(transform=TRANSFORM))
    with mounted_tmpfs(tmp_path / "small", "8k") as disk:
        store = DecodedStore()
        data = kept(spec, store, memory=0, disk=1 << 30, spill_root=disk)
        first = read(data, RANGES)
        assert all(torch.equal(a, b) for a, b in zip(first, read(data, RANGES)))
        counts = store.release("job")
        assert counts.disk_bytes <= 8192 and counts.not_kept > 0 and counts.decoded + counts.reused == 48
        assert list(disk.iterdir()) == []


def test_samples_decoded_in_loader_workers_are_kept(folder):
    """With DataLoader workers the missing ranges are decoded in the workers (as uint8) and
    kept here; the next pass decodes nothing."""
    spec = describe_dataset(folder / "photos", ReadOptions(transform=TRANSFORM))
    store = DecodedStore()
    data = kept(spec, store, memory=1 << 30)
    plain = read(spec.open(), RANGES)
    assert all(torch.equal(a, b) for a, b in zip(plain, read(data, RANGES, workers=2)))
    assert all(torch.equal(a, b) for a, b in zip(plain, read(data, RANGES, workers=2)))
    assert store.release("job") == KeptCounts(24, 24, 24 * SAMPLE_BYTES, 0, 0)


def test_a_rank_keeps_one_job_at_a_time(folder):
    """A rank's store drops a job's samples when the next job's first pass begins."""
    spec = describe_dataset(folder / "photos", ReadOptions(transform=TRANSFORM))
    store = DecodedStore(one_scope=True)
    read(kept(spec, store, memory=1 << 30), RANGES)
    other = KeepDecoded("next job", "calibration", 1 << 30, 0)
    read(KeptData(spec.open(), store.scope(other), "calibration"), RANGES)
    assert store.release("job") == KeptCounts()
    assert store.release("next job").decoded == 24


def test_arrays_are_not_kept_and_unmarked_data_is_read_as_it_is(folder, tmp_path):
    """Arrays cost no decode: a marked array dataset is read as it is; so is any unmarked one."""
    import numpy as np
    from dataclasses import replace

    np.save(tmp_path / "x.npy", np.ones((4, 3, 8, 8), dtype=np.float32))
    arrays = describe_dataset(tmp_path / "x.npy")
    keep = KeepDecoded("job", "calibration", 1 << 30, 0)
    assert not isinstance(open_kept(replace(arrays, keep=keep), arrays.open()), KeptData)
    images = describe_dataset(folder / "photos", ReadOptions(transform=TRANSFORM))
    assert not isinstance(open_kept(images, images.open()), KeptData)
    assert isinstance(open_kept(replace(images, keep=keep), images.open()), KeptData)


def test_shipped_images_are_kept_as_their_crops(folder, ray_cluster):
    """Images that came through the object store are decoded once on the rank too."""
    spec = describe_dataset(folder / "photos", ReadOptions(transform=TRANSFORM))
    [shard] = ship_dataset(spec, [RANGES])
    store = DecodedStore()
    data = kept(spec, store, memory=1 << 30, opened=shard)
    plain = read(spec.open(), RANGES)
    assert all(torch.equal(a, b) for a, b in zip(plain, read(data, RANGES)))
    assert all(torch.equal(a, b) for a, b in zip(plain, read(data, RANGES)))
    assert store.release("job") == KeptCounts(24, 24, 24 * SAMPLE_BYTES, 0, 0)
