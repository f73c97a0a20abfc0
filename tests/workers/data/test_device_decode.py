"""Decoding on the rank's device (workers.data.device_decode), run here with the CPU device:
the same calls a CUDA rank makes, torchvision's JPEG decoder in place of nvJPEG. The crops
are within one level of the CPU path's; what is not a JPEG, and a JPEG that fails, goes the
CPU path's way; the choice is by device."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from bnrecal import DatasetError
from bnrecal.workers.data import describe_dataset, iter_batches, ship_dataset
from bnrecal.workers.data.device_decode import DeviceDecoded, decode_on_device, on_device
from bnrecal.workers.data.kept import DecodedStore, KeepDecoded, KeptData
from tests.shards import folder_order, photos, write_folder, write_tar_shards

TRANSFORM = {"resize": 40, "crop": 32}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("device-decode")
    items = photos(12, size=64)
    write_folder(root / "photos", items)
    write_tar_shards(root / "shards", folder_order(items), 5)
    return root


@pytest.mark.parametrize("source", ["photos", "shards"])
def test_device_crops_are_within_one_level_of_the_cpu_path(folder, source):
    spec = describe_dataset(folder / source, transform=TRANSFORM)
    plain = spec.open()
    device = DeviceDecoded(spec.open(), CPU)
    kept, crops = plain.load_kept(0, 12), device.load_kept(0, 12)
    assert crops.dtype == torch.uint8 and crops.shape == kept.shape
    assert (crops.int() - kept.int()).abs().max() <= 1
    floats = torch.cat(list(iter_batches(device, [(0, 5), (5, 12)])))
    assert floats.dtype == torch.float32 and torch.allclose(floats, plain.load(0, 12), atol=1.01 / 255 / 0.224)


def test_other_formats_and_a_broken_jpeg_go_the_cpu_way(folder):
    transform = describe_dataset(folder / "photos", transform=TRANSFORM).transform
    buffer = io.BytesIO()
    Image.fromarray(np.full((50, 60, 3), 90, dtype=np.uint8)).save(buffer, format="PNG")
    png = buffer.getvalue()
    jpeg = photos(1, size=64)[0][1]
    samples = decode_on_device([("a.png", png), ("b.jpg", jpeg)], transform, CPU)
    assert torch.equal(samples[0], torch.full((3, 32, 32), 90, dtype=torch.uint8))  # PNG: the CPU path, exactly
    with pytest.raises(DatasetError, match="c.jpg"):
        decode_on_device([("b.jpg", jpeg), ("c.jpg", jpeg[:200])], transform, CPU)


def test_kept_on_the_host_for_later_passes(folder):
    """A CUDA rank keeps its device-decoded crops in host memory like any rank."""
    spec = describe_dataset(folder / "photos", transform=TRANSFORM)
    store = DecodedStore()
    data = KeptData(DeviceDecoded(spec.open(), CPU), store.scope(KeepDecoded("job", "calibration", 1 << 30, 0)),
                    "calibration")
    first = list(iter_batches(data, [(0, 6), (6, 12)]))
    assert all(torch.equal(a, b) for a, b in zip(first, iter_batches(data, [(0, 6), (6, 12)])))
    assert store.release("job").reused == 12


def test_chosen_by_device(folder, tmp_path, ray_cluster):
    """Images (from a folder, shards or the object store) are decoded on a CUDA rank's device;
    arrays and CPU ranks read as before. (Choosing touches no GPU: nothing runs on one here.)"""
    images = describe_dataset(folder / "photos", transform=TRANSFORM)
    shards = describe_dataset(folder / "shards", transform=TRANSFORM)
    np.save(tmp_path / "x.npy", np.zeros((4, 3, 8, 8), dtype=np.float32))
    arrays = describe_dataset(tmp_path / "x.npy")
    [shipped] = ship_dataset(images, [[(0, 12)]])
    for data in (images.open(), shards.open(), shipped):
        assert isinstance(on_device(data, "cuda"), DeviceDecoded)
        assert on_device(data, "cpu") is data
    opened = arrays.open()
    assert on_device(opened, "cuda") is opened
