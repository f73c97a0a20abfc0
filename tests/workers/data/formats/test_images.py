"""Calibration data from image folders: layout, order, labels, the transform, batch iteration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bnrecal.workers.data import DEFAULT_TRANSFORM, DataAccess, DatasetSpec, ReadOptions, describe_dataset, iter_batches
from bnrecal.errors import DatasetError, DatasetOptionError

IDENTITY = {"resize": 8, "crop": 8, "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}
MEAN = np.array(DEFAULT_TRANSFORM["mean"], dtype=np.float32)
STD = np.array(DEFAULT_TRANSFORM["std"], dtype=np.float32)


def expected_image(path: Path, resize: int = 256, crop: int = 224, mean=MEAN, std=STD) -> np.ndarray:
    """The ImageNet evaluation preset computed by hand with PIL and numpy."""
    image = Image.open(path).convert("RGB")
    width, height = image.size
    if width <= height:
        size = (resize, int(resize * height / width))
    else:
        size = (int(resize * width / height), resize)
    image = image.resize(size, Image.BILINEAR)
    left, top = round((size[0] - crop) / 2), round((size[1] - crop) / 2)
    pixels = np.asarray(image.crop((left, top, left + crop, top + crop)), dtype=np.float32) / 255
    return ((pixels - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)).transpose(2, 0, 1)


def random_rgb(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_flat_image_folder_in_sorted_path_order(tmp_path: Path) -> None:
    colours = {"b.png": 10, "a.png": 20, "c10.png": 30, "c2.png": 40, "A.png": 50}
    for name, level in colours.items():
        Image.new("RGB", (8, 8), (level, level, level)).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("ignored")
    (tmp_path / ".hidden.png").write_bytes(b"ignored, not an image")
    spec = describe_dataset(tmp_path, ReadOptions(transform=IDENTITY))
    assert (spec.kind, spec.num_samples, spec.sample_shape, spec.classes) == ("images", 5, (3, 8, 8), ())
    batch = spec.open().load(0, 5)
    order = sorted(colours)  # A.png, a.png, b.png, c10.png, c2.png
    np.testing.assert_allclose(batch[:, 0, 0, 0].numpy() * 255, [colours[n] for n in order], atol=1e-4)


def test_class_folders_give_classes_and_labels(tmp_path: Path) -> None:
    layout = {"dog/1.png": 1, "cat/2.png": 2, "cat/1.png": 3, "bird/9.png": 4, "dog/deep/0.png": 5}
    for name, level in layout.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (level, 0, 0)).save(tmp_path / name)
    spec = describe_dataset(tmp_path, ReadOptions(transform=IDENTITY))
    assert spec.classes == ("bird", "cat", "dog")
    data = spec.open()
    order = sorted(layout)  # deeper nesting is flattened into its class folder
    assert data.files == tuple(order)
    assert data.labels == tuple(spec.classes.index(n.split("/")[0]) for n in order)
    np.testing.assert_allclose(data.load(0, 5)[:, 0, 0, 0].numpy() * 255, [layout[n] for n in order], atol=1e-4)


def test_images_beside_class_folders_are_refused(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "cat" / "a.png")
    Image.new("RGB", (4, 4)).save(tmp_path / "stray.png")
    with pytest.raises(DatasetError, match="stray.png"):
        describe_dataset(tmp_path)


def test_a_single_wrapper_folder_is_descended(tmp_path: Path) -> None:
    for name in ("calib/cat/a.png", "calib/dog/b.png", "__MACOSX/calib/._a.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4)).save(tmp_path / name, format="PNG")
    spec = describe_dataset(tmp_path, ReadOptions(transform={"resize": 4, "crop": 4}))
    assert spec.classes == ("cat", "dog") and spec.num_samples == 2
    assert Path(spec.path) == (tmp_path / "calib").absolute()


def test_default_transform_matches_a_hand_computed_preset(tmp_path: Path) -> None:
    random_rgb(3, 30, 20).save(tmp_path / "tall.png")  # shorter side 20 -> 256, crop 224
    random_rgb(4, 17, 41).save(tmp_path / "wide.png")
    spec = describe_dataset(tmp_path)
    assert spec.sample_shape == (3, 224, 224) and spec.transform is not None
    assert spec.transform.to_dict() == DEFAULT_TRANSFORM
    batch = spec.open().load(0, 2)
    np.testing.assert_allclose(batch[0].numpy(), expected_image(tmp_path / "tall.png"), atol=1e-5)
    np.testing.assert_allclose(batch[1].numpy(), expected_image(tmp_path / "wide.png"), atol=1e-5)


def test_custom_transform_with_odd_sizes(tmp_path: Path) -> None:
    random_rgb(5, 23, 31).save(tmp_path / "a.png")
    options = {"resize": 17, "crop": 9, "mean": [0.5, 0.25, 0.0], "std": [0.5, 2.0, 1.0]}
    batch = describe_dataset(tmp_path, ReadOptions(transform=options)).open().load(0, 1)
    expected = expected_image(tmp_path / "a.png", 17, 9, options["mean"], options["std"])
    np.testing.assert_allclose(batch[0].numpy(), expected, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "pil_format", "mode"),
    [
        ("a.jpg", "JPEG", "RGB"), ("b.JPEG", "JPEG", "L"), ("c.png", "PNG", "RGBA"), ("d.PNG", "PNG", "P"),
        ("e.webp", "WEBP", "RGB"), ("f.bmp", "BMP", "RGB"),
    ],
)
def test_each_image_format_and_mode(tmp_path: Path, name: str, pil_format: str, mode: str) -> None:
    random_rgb(6, 12, 14).convert(mode).save(tmp_path / name, format=pil_format)
    batch = describe_dataset(tmp_path, ReadOptions(transform={"resize": 10, "crop": 10})).open().load(0, 1)
    expected = expected_image(tmp_path / name, 10, 10)
    np.testing.assert_allclose(batch[0].numpy(), expected, atol=1e-5)


def test_sixteen_bit_greyscale_is_scaled_not_clipped(tmp_path: Path) -> None:
    levels = np.full((6, 6), 257 * 100, dtype=np.uint16)
    Image.fromarray(levels).save(tmp_path / "deep.png")
    batch = describe_dataset(tmp_path, ReadOptions(transform={**IDENTITY, "resize": 6, "crop": 6})).open().load(0, 1)
    np.testing.assert_allclose(batch.numpy() * 255, 100.0, atol=1e-4)


def test_corrupt_images_are_named(tmp_path: Path) -> None:
    random_rgb(7, 16, 16).save(tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DatasetError, match="bad.png"):
        describe_dataset(tmp_path)
    (tmp_path / "bad.png").unlink()
    random_rgb(8, 64, 64).save(tmp_path / "cut.jpg", quality=95)
    whole = (tmp_path / "cut.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(whole[: len(whole) // 2])  # header intact, scan data cut
    spec = describe_dataset(tmp_path, ReadOptions(transform={"resize": 8, "crop": 8}))
    data = spec.open()
    with pytest.raises(DatasetError, match=r"cut\.jpg") as caught:
        data.load(0, 2)
    assert "\n" not in str(caught.value) and str(tmp_path) not in str(caught.value)


def test_empty_folders_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no images"):
        describe_dataset(tmp_path)
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "readme.md").write_text("no images here")
    with pytest.raises(DatasetError, match="no images"):
        describe_dataset(tmp_path)


@pytest.mark.parametrize(
    ("transform", "field"),
    [
        ({"resise": 256}, "transform.resise"),
        ({"resize": 0}, "transform.resize"),
        ({"crop": "224"}, "transform.crop"),
        ({"crop": True}, "transform.crop"),
        ({"resize": 100, "crop": 224}, "transform.crop"),
        ({"mean": [0.5, 0.5]}, "transform.mean"),
        ({"std": [0.2, 0.0, 0.2]}, "transform.std"),
        ({"std": [0.2, float("nan"), 0.2]}, "transform.std"),
        (["resize"], "transform"),
    ],
)
def test_invalid_transforms_name_the_key(tmp_path: Path, transform: object, field: str) -> None:
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    with pytest.raises(DatasetOptionError) as caught:
        describe_dataset(tmp_path, ReadOptions(transform=transform))  # type: ignore[arg-type]
    assert caught.value.field == field and field in str(caught.value)


def test_image_folder_changed_after_describe_is_detected(tmp_path: Path) -> None:
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    spec = describe_dataset(tmp_path, ReadOptions(transform={"resize": 4, "crop": 4}))
    Image.new("RGB", (4, 4)).save(tmp_path / "0.png")
    with pytest.raises(DatasetError, match="changed"):
        spec.open()


def write_digits_tree(root: Path, count: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Real 8x8 digit scans from scikit-learn as PNGs under one folder per digit."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    names, pixels = [], []
    for index in range(count):
        name = f"{digits.target[index]}/{index:04d}.png"
        grey = np.rint(digits.images[index] * 255 / 16).astype(np.uint8)
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(grey).save(root / name)
        names.append(name)
        pixels.append(grey)
    order = np.argsort(names)
    return sorted(names), np.stack(pixels)[order], digits.target[:count][order]


def test_sklearn_digits_read_back_from_class_folders(tmp_path: Path) -> None:
    names, pixels, targets = write_digits_tree(tmp_path, 60)
    spec = describe_dataset(tmp_path, ReadOptions(transform=IDENTITY))
    assert spec.classes == tuple(str(d) for d in sorted(set(targets)))
    data = spec.open()
    assert list(data.files) == names
    assert [int(spec.classes[label]) for label in data.labels] == list(targets)
    batch = data.load(0, 60)
    expected = np.repeat(pixels[:, None].astype(np.float32) / 255, 3, axis=1)
    np.testing.assert_allclose(batch.numpy(), expected, atol=1e-6)


def step_ranges(num_samples: int, batch: int, world: int, rank: int) -> list[tuple[int, int]]:
    """The sharding for one rank (docs/calibration.md, "Sharding"): its part of every global step."""
    ranges = []
    for start in range(0, num_samples, batch):
        part = np.array_split(np.arange(start, min(start + batch, num_samples)), world)[rank]
        ranges.append((int(part[0]), int(part[-1]) + 1) if len(part) else (start, start))
    return ranges


def test_iter_batches_with_workers_matches_in_process(tmp_path: Path) -> None:
    write_digits_tree(tmp_path, 21)
    spec: DatasetSpec = describe_dataset(tmp_path, ReadOptions(transform={"resize": 12, "crop": 10}))
    data = spec.open()
    ranges = step_ranges(21, 6, 4, 3)  # the last step (3 samples) gives this rank an empty slice
    assert any(start == stop for start, stop in ranges)
    serial = list(iter_batches(data, ranges, num_workers=0))
    parallel = list(iter_batches(data, ranges, num_workers=2))
    assert [b.shape[0] for b in serial] == [stop - start for start, stop in ranges]
    assert len(parallel) == len(serial)
    for one, other in zip(serial, parallel, strict=True):
        assert torch.equal(one, other)
    indices = torch.cat([torch.arange(start, stop) for start, stop in ranges])
    assert torch.equal(torch.cat(parallel), data.load(0, 21)[indices])


def test_iter_batches_worker_errors_keep_their_one_line_message(tmp_path: Path) -> None:
    random_rgb(10, 8, 8).save(tmp_path / "a.png")
    (tmp_path / "b.png").write_bytes(b"broken")
    data = describe_dataset(
        tmp_path, ReadOptions(transform={"resize": 8, "crop": 8}), DataAccess(check_images=False),
    ).open()
    with pytest.raises(DatasetError, match=r"^cannot decode image b\.png") as caught:
        list(iter_batches(data, [(0, 1), (1, 2)], num_workers=2))
    assert "\n" not in str(caught.value)
