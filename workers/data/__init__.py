"""Calibration data: describe a dataset once on the driver, read row ranges in each actor.

Arrays (``.npy``/``.npz``) are memory-mapped or streamed, never loaded whole; image
folders and archives of images are decoded and transformed batch by batch. See
:mod:`workers.data.formats.images` for the folder layout rules and :mod:`workers.data.formats.archive`
for the unpacking safety rules. This room imports only torch, numpy, PIL, fsspec, Ray's
object store (``reading.shipping``) and the shared helpers at the top of ``workers``: nothing of
``engine``, ``models``, ``programs`` or ``ranks``.
"""

from __future__ import annotations

from bnrecal.workers.data.formats.archive import (
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MAX_UNPACKED_BYTES,
    default_unpack_root,
    discard_unpack,
)
from bnrecal.workers.data.formats.arrays import ArrayData
from bnrecal.workers.data.formats.npy_layout import ArrayLayout
from bnrecal.workers.data.opened import CalibrationData
from bnrecal.workers.data.options import DataAccess, ReadOptions
from bnrecal.workers.data.reading.batches import iter_batches
from bnrecal.workers.data.formats.images import IMAGE_EXTENSIONS, ImageData
from bnrecal.workers.data.reading.shipping import ShippedData, ship_dataset
from bnrecal.workers.data.file_formats import FILE_FORMATS, detect_format, format_named
from bnrecal.workers.data.shards.shard_formats import SHARD_FORMATS, columned, shard_format
from bnrecal.workers.data.spec import DatasetSpec, describe_dataset, read_labels
from bnrecal.workers.data.summary import DatasetSummary
from bnrecal.workers.data.formats.transform import DEFAULT_TRANSFORM, ImageTransform, resolve_transform

__all__ = [
    "DEFAULT_MAX_MEMBERS",
    "DEFAULT_MAX_UNPACKED_BYTES",
    "DEFAULT_TRANSFORM",
    "FILE_FORMATS",
    "IMAGE_EXTENSIONS",
    "SHARD_FORMATS",
    "ArrayData",
    "ArrayLayout",
    "CalibrationData",
    "DataAccess",
    "DatasetSpec",
    "DatasetSummary",
    "ImageData",
    "ImageTransform",
    "ReadOptions",
    "ShippedData",
    "columned",
    "default_unpack_root",
    "describe_dataset",
    "detect_format",
    "discard_unpack",
    "format_named",
    "iter_batches",
    "read_labels",
    "resolve_transform",
    "ship_dataset",
    "shard_format",
]
