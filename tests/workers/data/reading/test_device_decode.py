"""Decoding on the rank's device (workers.data.reading.device_decode), run here with the CPU device:
the same calls a CUDA rank makes, torchvision's JPEG decoder in place of nvJPEG (and nvJPEG
itself in the gpu-marked cases, where a CUDA device is present). JPEGs without chroma
subsampling are decoded on the device, their crops within one level of the CPU path's;
subsampled JPEGs, what is not a JPEG, and a JPEG that fails go the CPU path's way, exactly;
the choice is by device and by the first sample's encoding."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from bnrecal import DatasetError
from bnrecal.workers.data import ReadOptions, describe_dataset, iter_batches, ship_dataset
from bnrecal.workers.data.reading.device_decode import DeviceDecoded, decode_on_device, decodes_exactly, on_device
from bnrecal.workers.data.reading.kept import DecodedStore, KeepDecoded, KeptData
from tests.shards import folder_order, photos, write_folder, write_tar_shards

TRANSFORM = {"resize": 40, "crop": 32}
CPU = torch.device("cpu")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The same 12 photos saved without chroma subsampling (``full``) and as most photos are
    (``subsampled``, 4:2:0), each as a folder and as tar shards."""
    root = tmp_path_factory.mktemp("device-decode")
    for name, subsampling in (("full", "4:4:4"), ("subsampled", "4:2:0")):
        items = photos(12, size=64, subsampling=subsampling)
        write_folder(root / name / "photos", items)
        write_tar_shards(root / name / "shards", folder_order(items), 5)
    return root


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("source", ["photos", "shards"])
def test_device_crops_are_within_one_level_of_the_cpu_path(folder, source, device):
    spec = describe_dataset(folder / "full" / source, ReadOptions(transform=TRANSFORM))
    plain = spec.open()
    device = DeviceDecoded(spec.open(), torch.device(device))
    kept, crops = plain.load_kept(0, 12), device.load_kept(0, 12)
    assert crops.dtype == torch.uint8 and crops.shape == kept.shape
    assert not torch.equal(crops, kept)  # decoded on the device, not by the CPU path
    assert (crops.int() - kept.int()).abs().max() <= 1
    floats = torch.cat(list(iter_batches(device, [(0, 5), (5, 12)])))
    assert floats.dtype == torch.float32 and torch.allclose(floats, plain.load(0, 12), atol=1.01 / 255 / 0.224)


@pytest.mark.parametrize("device", DEVICES)
def test_subsampled_jpegs_are_decoded_by_the_cpu_path_exactly(folder, device):
    """nvJPEG fills in subsampled colour otherwise than libjpeg-turbo (up to 48 levels apart
    on an H200): such JPEGs never reach it, and their crops are the CPU path's, bit for bit."""
    spec = describe_dataset(folder / "subsampled" / "photos", ReadOptions(transform=TRANSFORM))
    assert torch.equal(DeviceDecoded(spec.open(), torch.device(device)).load_kept(0, 12), spec.open().load_kept(0, 12))


def test_which_jpegs_decode_exactly_on_the_device():
    full, subsampled = photos(1, subsampling="4:4:4")[0][1], photos(1)[0][1]
    buffer = io.BytesIO()
    Image.fromarray(np.full((20, 20), 7, dtype=np.uint8)).save(buffer, format="JPEG")
    grey = buffer.getvalue()
    buffer = io.BytesIO()
    Image.fromarray(np.full((20, 20, 4), 7, dtype=np.uint8), mode="CMYK").save(buffer, format="JPEG")
    assert decodes_exactly(full) and decodes_exactly(grey)
    assert not decodes_exactly(subsampled) and not decodes_exactly(buffer.getvalue())
    assert not decodes_exactly(full[:2]) and not decodes_exactly(full[:40])  # not a JPEG; a header cut short


def test_other_formats_and_a_broken_jpeg_go_the_cpu_way(folder):
    transform = describe_dataset(folder / "full" / "photos", ReadOptions(transform=TRANSFORM)).transform
    buffer = io.BytesIO()
    Image.fromarray(np.full((50, 60, 3), 90, dtype=np.uint8)).save(buffer, format="PNG")
    png = buffer.getvalue()
    jpeg = photos(1, size=64, subsampling="4:4:4")[0][1]
    samples = decode_on_device([("a.png", png), ("b.jpg", jpeg)], transform, CPU)
    assert torch.equal(samples[0], torch.full((3, 32, 32), 90, dtype=torch.uint8))  # PNG: the CPU path, exactly
    with pytest.raises(DatasetError, match="c.jpg"):
        decode_on_device([("b.jpg", jpeg), ("c.jpg", jpeg[:200])], transform, CPU)


def test_kept_on_the_host_for_later_passes(folder):
    """A CUDA rank keeps its device-decoded crops in host memory like any rank."""
    spec = describe_dataset(folder / "full" / "photos", ReadOptions(transform=TRANSFORM))
    store = DecodedStore()
    data = KeptData(DeviceDecoded(spec.open(), CPU), store.scope(KeepDecoded("job", "calibration", 1 << 30, 0)),
                    "calibration")
    first = list(iter_batches(data, [(0, 6), (6, 12)]))
    assert all(torch.equal(a, b) for a, b in zip(first, iter_batches(data, [(0, 6), (6, 12)])))
    assert store.release("job").reused == 12


def test_chosen_by_device_and_by_the_first_sample(folder, tmp_path, ray_cluster):
    """Images (from a folder, shards or the object store) whose first sample is a JPEG the
    device decodes exactly are decoded on a CUDA rank's device; subsampled photos, arrays
    and CPU ranks read as before, by loader processes. (Choosing touches no GPU.)"""
    np.save(tmp_path / "x.npy", np.zeros((4, 3, 8, 8), dtype=np.float32))
    arrays = describe_dataset(tmp_path / "x.npy").open()
    for name, on_gpu in (("full", True), ("subsampled", False)):
        images = describe_dataset(folder / name / "photos", ReadOptions(transform=TRANSFORM))
        shards = describe_dataset(folder / name / "shards", ReadOptions(transform=TRANSFORM))
        [shipped] = ship_dataset(images, [[(0, 12)]])
        for data in (images.open(), shards.open(), shipped):
            assert isinstance(on_device(data, "cuda"), DeviceDecoded) is on_gpu
            assert on_device(data, "cpu") is data
            assert (on_device(data, "cuda") is data) is not on_gpu
    assert on_device(arrays, "cuda") is arrays
