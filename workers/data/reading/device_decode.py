"""JPEG decoded on the rank's device: nvJPEG on CUDA ranks, chosen by device as the
collective backend is (docs/data.md, "Decoding on CUDA ranks").

A CUDA rank reading images does not decode them in CPU loader processes. It reads a batch's
encoded bytes (cheap reads), decodes its JPEGs together with
``torchvision.io.decode_jpeg(..., device="cuda")``, and resizes and centre-crops them there
with the same torchvision operations on tensors. The uint8 crops come back to host memory,
where the rank keeps them for the job's later passes (``workers.data.reading.kept``) and where
every later step is the CPU path's. A sample that is not a JPEG (PNG, WebP, BMP, ``.npy``), a
JPEG whose colour is subsampled (4:2:0, 4:2:2: most photos), and one that the device decoder
refuses (a CMYK JPEG, say) is decoded by the CPU path.

Subsampled JPEGs stay on the CPU because nvJPEG fills in the missing colour samples
otherwise than libjpeg-turbo (which PIL and torchvision's CPU decoder use): measured on an
H200 (``bench/gpu_check.sh``), up to 48 levels apart at colour edges, 1.2 on average, which
moved resnet50's BN variances by about 1% of a layer's, a bias no amount of data averages
away. Without subsampling (4:4:4, greyscale) the two decoders agree exactly, and the crops
are within one level of 255 of the CPU path's (PIL's resize against torchvision's), so
statistics from CUDA ranks differ from CPU ranks' in their last digits only.
"""

from __future__ import annotations

import io

import torch

from bnrecal.workers.data.opened import CalibrationData, DecodedData
from bnrecal.workers.data.shards.dataset import decode_kept, kept_batch
from bnrecal.workers.data.formats.transform import ImageTransform

JPEG_MAGIC = b"\xff\xd8\xff"


def on_device(data: CalibrationData, device: str | torch.device) -> CalibrationData:
    """``data`` as a rank on ``device`` reads it: on CUDA, images whose encoded bytes the
    data gives (``encoded``) are decoded there when the first is a JPEG the device decodes
    exactly (:func:`decodes_exactly`; photos of one source share their encoding, and
    subsampled ones are read as on a CPU rank, by loader processes); anything else is read
    as it is."""
    if torch.device(device).type != "cuda" or getattr(data, "transform", None) is None:
        return data
    if data.encoded(0, 0) is None:  # this data gives no encoded bytes: decoded by its own load
        return data
    first = data.first_encoded()
    if first is not None and not decodes_exactly(first[1]):
        return data
    return DeviceDecoded(data, torch.device(device))


class DeviceDecoded(DecodedData):
    """An image dataset whose JPEGs are decoded on ``device`` (:func:`decode_on_device`)."""

    def __init__(self, inner: CalibrationData, device: torch.device) -> None:
        self.inner = inner
        self.device = device
        self.transform: ImageTransform = inner.transform  # type: ignore[attr-defined]
        self.sample_shape = inner.sample_shape

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def decodes(self) -> bool:
        return False  # read in this process: the device decodes, not loader processes

    @property
    def worth_keeping(self) -> bool:
        return self.inner.worth_keeping

    def load_kept(self, start: int, stop: int) -> torch.Tensor:
        """The batch's uint8 crops, its JPEGs decoded on the device, in host memory."""
        self._check_range(start, stop)
        if start == stop:
            return self._empty().to(torch.uint8)
        encoded = self.inner.encoded(start, stop)
        assert encoded is not None
        return kept_batch(decode_on_device(encoded, self.transform, self.device), self.transform)

    def from_kept(self, kept: torch.Tensor) -> torch.Tensor:
        return self.inner.from_kept(kept)

    def encoded(self, start: int, stop: int) -> list[tuple[str, bytes]] | None:
        return self.inner.encoded(start, stop)

    def first_encoded(self) -> tuple[str, bytes] | None:
        return self.inner.first_encoded()

    def plan_reads(self, ranges: list[tuple[int, int]]) -> None:
        """The ranges this pass reads, for a reader that reads ahead (shards in a shuffled order)."""
        plan = getattr(self.inner, "plan_reads", None)
        if plan is not None:
            plan(ranges)

    def close(self) -> None:
        self.inner.close()


def decode_on_device(encoded: list[tuple[str, bytes]], transform: ImageTransform, device: torch.device) -> list[torch.Tensor]:
    """Each sample's crop in host memory (uint8 ``(3, crop, crop)``, or an ``.npy`` sample as
    float32): the JPEGs decoded together on ``device``, resized and cropped there; the others
    (and a JPEG the device refuses) by the CPU path, whose errors name the sample."""
    from torchvision.io import ImageReadMode, decode_jpeg

    jpegs = [i for i, (_, data) in enumerate(encoded) if decodes_exactly(data)]
    out: list[torch.Tensor | None] = [None] * len(encoded)
    if jpegs:
        raw = [torch.frombuffer(bytearray(encoded[i][1]), dtype=torch.uint8) for i in jpegs]
        try:
            images = decode_jpeg(raw, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # one the device refuses: the CPU path decodes the batch's JPEGs, naming a bad one
            images = [None] * len(jpegs)
        for i, image in zip(jpegs, images):
            if image is not None:
                out[i] = _crop(image, transform).cpu()
    return [sample if sample is not None else decode_kept(name, data, transform)
            for sample, (name, data) in zip(out, encoded)]


def decodes_exactly(data: bytes) -> bool:
    """Whether nvJPEG decodes ``data`` as the CPU path does: a JPEG in RGB or greyscale whose
    colour is not subsampled (its header's sampling factors, read by PIL without decoding)."""
    if data[:3] != JPEG_MAGIC:
        return False
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            layers = getattr(image, "layer", None)
            return image.mode in ("RGB", "L") and bool(layers) and len({(h, v) for _, h, v, _ in layers}) == 1
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        return False  # the CPU path decodes it, or names it in its error


def _crop(image: torch.Tensor, transform: ImageTransform) -> torch.Tensor:
    """The transform's resize and centre crop of a decoded ``(3, H, W)`` uint8 image, where it lies."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    image = TF.resize(image, [transform.resize], interpolation=InterpolationMode.BILINEAR, antialias=True)
    return TF.center_crop(image, [transform.crop, transform.crop])
