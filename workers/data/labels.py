"""Labels of evaluation data: the class folders of an image set, or ``y`` beside ``x`` in an ``.npz``.

Labels are small (one integer per sample), so the driver reads them whole and hands
each rank the labels of its own samples; the samples themselves stay where they are.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from bnrecal.workers.data.formats.images import list_images, list_remote_images
from bnrecal.workers.data.storage.objectstore import open_remote_file, remote_error
from bnrecal.workers.data.shards.dataset import shard_labels
from bnrecal.workers.data.spec import DatasetSpec
from bnrecal.errors import DatasetError

LABEL_ARRAY = "y"
"""The ``.npz`` member holding one class index per sample of ``x``."""


def read_labels(spec: DatasetSpec) -> np.ndarray | None:
    """The class index of each of the dataset's samples (int64), or None when it has none.

    Labels follow the samples' order (``spec.order``). Image folders are labelled by their class folders (sorted names, index = position,
    as torchvision's ImageFolder); an ``.npz`` by an integer array ``y`` of one label
    per row of ``x``. A ``y`` that does not fit ``x`` is an error, never silently ignored.
    Shards are labelled by each sample's ``KEY.cls`` or the label column, and every sample
    must have one: evaluation shards without labels fail, naming what is missing.
    """
    if spec.kind == "shards":
        assert spec.shards is not None
        return shard_labels(spec.shards, spec.sample_rows())
    if spec.kind == "images":
        if not spec.classes:
            return None
        if spec.remote is not None:
            listing = list_remote_images(spec.remote, "evaluation data")
        else:
            listing = list_images(Path(spec.path), strip_wrappers=False, shown=spec.display_name)
        return np.asarray(listing.labels, dtype=np.int64)[spec.sample_rows()]
    layout = spec.layout
    if layout is None or not layout.storage.startswith("npz"):
        return None
    name = spec.display_name
    try:
        stream = open_remote_file(spec.remote) if spec.remote is not None else open(spec.path, "rb")
    except Exception as exc:  # noqa: BLE001 - storage errors come in many types, all reported one way
        raise remote_error(exc, spec.remote, "evaluation data") if spec.remote else DatasetError(
            f"{name}: cannot read labels {LABEL_ARRAY!r}: {exc}"
        ) from exc
    try:
        with stream, zipfile.ZipFile(stream) as archive:
            if f"{LABEL_ARRAY}.npy" not in archive.namelist():
                return None
            _check_label_size(archive.getinfo(f"{LABEL_ARRAY}.npy"), spec.total_samples, name)
            stream.seek(0)
            with np.load(stream, allow_pickle=False) as arrays:
                labels = arrays[LABEL_ARRAY]
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{name}: cannot read labels {LABEL_ARRAY!r}: {exc}") from exc
    if labels.shape != (spec.total_samples,):
        raise DatasetError(
            f"{name}: labels {LABEL_ARRAY!r} have shape {labels.shape}; expected one per sample, "
            f"shape ({spec.total_samples},)"
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(f"{name}: labels {LABEL_ARRAY!r} must be integer class indices, not {labels.dtype}")
    labels = labels[spec.sample_rows()].astype(np.int64)
    if labels.size and int(labels.min()) < 0:
        raise DatasetError(f"{name}: labels {LABEL_ARRAY!r} must be class indices >= 0, found {int(labels.min())}")
    return labels


_LABEL_HEADER_BYTES = 4096
"""More than any ``.npy`` header of a 1-D array takes (numpy pads them to 64 or 128 bytes)."""


def _check_label_size(info: zipfile.ZipInfo, samples: int, name: str) -> None:
    """Refuse a ``y`` member larger than one 8-byte integer per sample before it is loaded:
    ``y`` is read whole, and a compressed one could otherwise expand to any size."""
    bound = _LABEL_HEADER_BYTES + 8 * samples
    if info.file_size > bound:
        raise DatasetError(
            f"{name}: labels {LABEL_ARRAY!r} take {info.file_size} bytes, more than one integer for each of "
            f"the {samples} samples; refusing them"
        )
