"""The image transform: validated options and the decode + resize + crop + normalise of one file."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bnrecal.errors import DatasetError, DatasetOptionError, message_line

DEFAULT_TRANSFORM: dict[str, Any] = {
    "resize": 256,
    "crop": 224,
    "mean": [0.485, 0.456, 0.406],
    "std": [0.229, 0.224, 0.225],
}
"""The ImageNet evaluation preset; a user's ``transform`` overrides it key by key."""

_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})


@dataclass(frozen=True)
class ImageTransform:
    """A validated image transform: shorter side to ``resize``, centre ``crop``, normalise."""

    resize: int
    crop: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def to_dict(self) -> dict[str, Any]:
        """The transform in the job-spec form (``resize``, ``crop``, ``mean``, ``std``)."""
        return {"resize": self.resize, "crop": self.crop, "mean": list(self.mean), "std": list(self.std)}

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """Shape of one transformed image: ``(3, crop, crop)``."""
        return (3, self.crop, self.crop)


def resolve_transform(transform: Mapping[str, Any] | None) -> ImageTransform:
    """Merge ``transform`` over the ImageNet preset and validate every key.

    Raises :class:`DatasetOptionError` naming the key (``transform.<key>``) on an unknown
    key, a non-positive size, a crop larger than the resize, or a bad mean/std.
    """
    if transform is None:
        transform = {}
    if not isinstance(transform, Mapping):
        raise DatasetOptionError(
            f"transform must be an object with keys {sorted(DEFAULT_TRANSFORM)}, got {type(transform).__name__}",
            field="transform",
        )
    unknown = sorted(str(k) for k in transform if k not in DEFAULT_TRANSFORM)
    if unknown:
        raise DatasetOptionError(
            f"unknown key transform.{unknown[0]} (known: {', '.join(sorted(DEFAULT_TRANSFORM))})",
            field=f"transform.{unknown[0]}",
        )
    merged = {**DEFAULT_TRANSFORM, **transform}
    resize = _positive_int(merged["resize"], "resize")
    crop = _positive_int(merged["crop"], "crop")
    if crop > resize:
        raise DatasetOptionError(
            f"transform.crop ({crop}) must not exceed transform.resize ({resize})", field="transform.crop"
        )
    mean = _three_numbers(merged["mean"], "mean")
    std = _three_numbers(merged["std"], "std")
    if any(s <= 0 for s in std):
        raise DatasetOptionError(f"transform.std values must be > 0, got {list(std)}", field="transform.std")
    return ImageTransform(resize=resize, crop=crop, mean=mean, std=std)


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise DatasetOptionError(
            f"transform.{key} must be a positive integer, got {value!r}", field=f"transform.{key}"
        )
    return int(value)


def _three_numbers(value: Any, key: str) -> tuple[float, float, float]:
    ok = isinstance(value, list | tuple) and len(value) == 3
    if ok:
        ok = all(not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) for v in value)
    if not ok:
        raise DatasetOptionError(
            f"transform.{key} must be a list of 3 finite numbers (R, G, B), got {value!r}",
            field=f"transform.{key}",
        )
    return (float(value[0]), float(value[1]), float(value[2]))


def to_rgb(image: Image.Image) -> Image.Image:
    """The image as 8-bit RGB; 16-bit greyscale is scaled to 8 bits (PIL would clip it)."""
    if image.mode in _SIXTEEN_BIT_MODES:
        levels = np.asarray(image, dtype=np.float64) / 257.0
        image = Image.fromarray(np.clip(np.rint(levels), 0, 255).astype(np.uint8))
    if image.mode == "RGB":
        return image
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "palette images with transparency" note: alpha is dropped
        return image.convert("RGB")


def apply_transform(image: Image.Image, transform: ImageTransform) -> torch.Tensor:
    """An RGB PIL image as the normalised float32 tensor ``(3, crop, crop)`` fed to the model.

    Same steps as the torchvision ImageNet evaluation preset: bilinear antialiased resize
    of the shorter side, centre crop, scale to [0, 1], normalise by mean/std. It is
    :func:`crop_image` then :func:`normalize`: what a rank keeps between passes is the
    uint8 crop, which becomes the same floats, bit for bit, when read again.
    """
    return normalize(crop_image(image, transform), transform)


def crop_image(image: Image.Image, transform: ImageTransform) -> torch.Tensor:
    """The resized, centre-cropped RGB image as uint8 ``(3, crop, crop)``: the transform
    before its scaling and normalisation (a quarter of the float32 bytes)."""
    # torchvision is imported here, on the first image, not with the module: importing it
    # takes ~1.3 s (it imports torch._dynamo), which every rank would pay for array data too.
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    image = TF.resize(image, [transform.resize], interpolation=InterpolationMode.BILINEAR, antialias=True)
    image = TF.center_crop(image, [transform.crop, transform.crop])
    return TF.pil_to_tensor(image)


def normalize(crops: torch.Tensor, transform: ImageTransform) -> torch.Tensor:
    """uint8 crops (one ``(3, H, W)`` or a batch ``(N, 3, H, W)``) scaled to [0, 1] and
    normalised by mean/std, as float32. Elementwise, so a batch gives each sample's floats
    exactly as the sample alone would."""
    from torchvision.transforms.v2 import functional as TF

    tensor = TF.to_dtype(crops, torch.float32, scale=True)
    return TF.normalize(tensor, list(transform.mean), list(transform.std))


def load_image(path: Path, name: str, transform: ImageTransform) -> torch.Tensor:
    """Decode and transform one image file; a file that cannot be decoded is a DatasetError naming ``name``."""
    return normalize(decode_image(path, name, transform), transform)


def decode_image(path: Path, name: str, transform: ImageTransform) -> torch.Tensor:
    """Decode, resize and crop one image file to uint8 ``(3, crop, crop)`` (:func:`crop_image`);
    a file that cannot be decoded is a DatasetError naming ``name``."""
    try:
        with Image.open(path) as image:
            image.load()
            rgb = to_rgb(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DatasetError(f"cannot decode image {name}: {_one_line(exc, path, name)}") from exc
    return crop_image(rgb, transform)


def check_image_header(path: Path, name: str) -> None:
    """Read only the header of an image file, so an obviously broken file fails before the run."""
    try:
        with Image.open(path) as image:
            if image.width < 1 or image.height < 1:
                raise ValueError(f"empty image {image.width}x{image.height}")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DatasetError(f"cannot decode image {name}: {_one_line(exc, path, name)}") from exc


def _one_line(exc: BaseException, path: Path, name: str) -> str:
    """The error on one line, with the server-side path replaced by the dataset-relative name."""
    return message_line(exc, limit=10_000).replace(" ".join(str(path).split()), name)
