"""Data shipped through the object store reads back exactly as from the path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset, ship_dataset
from bnrecal.workers.ranks.sharding import rank_ranges

pytestmark = pytest.mark.usefixtures("ray_cluster")


def check_every_rank(spec, batch_size, world_size, block_bytes):
    direct = spec.open()
    ranges = [rank_ranges(spec.num_samples, batch_size, world_size, r) for r in range(world_size)]
    shards = ship_dataset(spec, ranges, block_bytes=block_bytes)
    assert len(shards) == world_size
    for rank_range, shard in zip(ranges, shards):
        for start, stop in rank_range:
            torch.testing.assert_close(shard.load(start, stop), direct.load(start, stop), rtol=0, atol=0)
    return shards


def test_arrays_in_small_blocks(tmp_path):
    array = np.random.default_rng(0).integers(0, 255, size=(29, 3, 4, 4), dtype=np.uint8)
    np.save(tmp_path / "x.npy", array)
    shards = check_every_rank(describe_dataset(tmp_path / "x.npy"), batch_size=5, world_size=3, block_bytes=300)
    assert len(shards[0].blocks) > 1  # several blocks, fetched one at a time
    with pytest.raises(IndexError):
        shards[0].load(*rank_ranges(29, 5, 3, 1)[0])  # another rank's range was never shipped here


def test_images_travel_encoded_and_decode_in_the_rank(tmp_path):
    rng = np.random.default_rng(1)
    for index in range(7):
        Image.fromarray(rng.integers(0, 255, size=(20, 24, 3), dtype=np.uint8)).save(tmp_path / f"{index}.png")
    spec = describe_dataset(tmp_path, ReadOptions(transform={"resize": 16, "crop": 12}))
    shards = check_every_rank(spec, batch_size=4, world_size=2, block_bytes=1 << 20)
    block = shards[1].blocks[0]
    import ray

    payload = ray.get(block.ref)
    assert isinstance(payload[0][1], bytes) and payload[0][1][:4] == b"\x89PNG"


@pytest.mark.parametrize("dtype", ["uint8", "float16", "float64", ">i2"])
def test_narrow_arrays_travel_narrow_and_arrive_as_float32(tmp_path, dtype):
    array = np.random.default_rng(2).integers(0, 120, size=(10, 3, 4, 4)).astype(dtype)
    np.save(tmp_path / "x.npy", array)
    np.savez_compressed(tmp_path / "x.npz", x=array)
    for name in ("x.npy", "x.npz"):
        shards = check_every_rank(describe_dataset(tmp_path / name), batch_size=4, world_size=2, block_bytes=1 << 20)
        import ray

        payload = ray.get(shards[0].blocks[0].ref)
        travelled = {"uint8": torch.uint8, "float16": torch.float16, "float64": torch.float32, ">i2": torch.int16}
        assert payload.dtype == travelled[dtype]
        assert sum(s.nbytes for s in shards) == 10 * 48 * payload.element_size()
        loaded = shards[1].load(*rank_ranges(10, 4, 2, 1)[0])
        assert loaded.dtype == torch.float32
        np.testing.assert_array_equal(loaded.numpy(), array[2:4].astype(np.float32))


@pytest.mark.parametrize("gz", [False, True])
def test_shard_samples_travel_encoded_and_decode_in_the_rank(tmp_path, gz):
    """Tar shards through the object store: each rank's members as their JPEG bytes, in the
    shuffled order's positions, decoding to what the shards give read in place."""
    from tests.shards import photos, write_tar_shards

    write_tar_shards(tmp_path / "s", photos(23, size=32), 8, gz=gz)
    spec = describe_dataset(
        tmp_path / "s",
        ReadOptions(transform={"resize": 16, "crop": 12}, order="shuffled", seed=3),
        DataAccess(unpack_root=tmp_path / "u"),
    )
    shards = check_every_rank(spec, batch_size=5, world_size=2, block_bytes=1 << 20)
    import ray

    name, data = ray.get(shards[0].blocks[0].ref)[0]
    assert name.startswith("train-00000") and ".jpg" in name and data[:2] == b"\xff\xd8"
