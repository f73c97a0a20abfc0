"""What ``bnrecal.recalibrate`` accepts as data, described once on the driver.

- a ``DataLoader`` over a map-style dataset: its batches are the global steps, in the
  order its sampler gives them on this call; each rank decodes only its own part of each
  step, through a DataLoader of its own over the same dataset (the ``collate_fn`` and
  ``num_workers`` kept), so the dataset (and ``collate_fn``) must pickle;
- a ``DataLoader`` over an iterable-style dataset, or any other iterable of batches:
  its batches are read on the driver (up to ``max_samples``), kept in memory and sent to
  the ranks, each of which slices its part of every step;
- a map-style ``Dataset`` (or a tensor or array of samples) with ``batch_size``;
- a path or ``s3://`` URI: what ``--data`` takes (docs/data.md), shards included (a
  folder or prefix of shards, a brace pattern, a manifest, Parquet, a ``save_to_disk`` folder);
- a list or tuple of shard paths or URIs (``["s3://b/train-000000.tar", ...]``): the shards
  in the list's order, streamed (docs/data.md).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from bnrecal.workers.data import DatasetSpec, ReadOptions, describe_dataset
from bnrecal.workers.data.formats.loader import LoaderSpec, batch_length, sample_shape, slice_batch
from bnrecal.workers.data.storage.objectstore import is_data_uri
from bnrecal.workers.data.shards.detection import is_shard_list
from bnrecal.errors import DatasetError, SpecError

from ..settings import Settings

PROBE_SAMPLES = 8
"""At most this many samples of the first step run on the driver (the probe, the export)."""


def is_path_data(data: Any) -> bool:
    """Whether ``data`` is what ``--data`` takes (a path or an ``s3://`` URI) or a list of shards."""
    return isinstance(data, (str, os.PathLike)) or is_data_uri(data) or is_shard_list(data)


def describe_python_data(
    data: Any, *, batch_size: int | None, max_samples: int | str | None, select_input: bool, settings: Settings,
    order: str = "shuffled", seed: int = 0, image_column: str | None = None, transform: dict[str, Any] | None = None,
) -> DatasetSpec | LoaderSpec:
    """Describe ``data`` for the ranks (see the module's docstring), refusing what cannot be.

    A path or URI is read in ``order`` (seeded ``shuffled`` by default, as ``--data``);
    data in memory keeps its own order. ``max_samples="auto"`` keeps every sample: the
    ranks stop once the statistics converge. ``image_column`` names the image column of
    Parquet or Arrow data, ``transform`` how images given as a path are read (each refused
    for any other data)."""
    if max_samples == "auto":
        max_samples = None
    if max_samples is not None and (isinstance(max_samples, bool) or int(max_samples) < 1):
        raise SpecError(f"max_samples must be an integer >= 1, got {max_samples!r}", field="max_samples")
    max_samples = None if max_samples is None else int(max_samples)
    if batch_size is not None and (isinstance(batch_size, bool) or int(batch_size) < 1):
        raise SpecError(f"batch_size must be an integer >= 1, got {batch_size!r}", field="batch_size")
    batch_size = None if batch_size is None else int(batch_size)
    if is_path_data(data):
        return describe_dataset(
            data if is_data_uri(data) or is_shard_list(data) else Path(data),
            ReadOptions(max_samples=max_samples, order=order, seed=seed, image_column=image_column, transform=transform),
            settings.data_access(),
        )
    if image_column is not None:
        raise SpecError("image_column names a column of Parquet or Arrow data given as a path or URI", field="image_column")
    if transform is not None:
        raise SpecError("transform says how images given as a path or URI are read; data in memory is already "
                        "tensors (transform it in its Dataset)", field="transform")
    if isinstance(data, (torch.Tensor, np.ndarray)):
        data = TensorDataset(torch.as_tensor(data))
    if isinstance(data, DataLoader):
        if batch_size is not None:
            raise SpecError(
                "batch_size goes with a Dataset: a DataLoader's own batches are the steps", field="batch_size"
            )
        if isinstance(data.dataset, IterableDataset) or data.batch_sampler is None:
            return _materialised(data, max_samples, select_input, "DataLoader (read on the driver)")
        steps = [list(step) for step in data.batch_sampler]
        return _loader_spec(data.dataset, steps, data.collate_fn, data.num_workers, max_samples, select_input,
                            f"DataLoader over {type(data.dataset).__name__}")
    if isinstance(data, Dataset) and not isinstance(data, IterableDataset) and hasattr(data, "__len__"):
        if batch_size is None:
            raise SpecError(f"a {type(data).__name__} needs batch_size (or pass a DataLoader)", field="batch_size")
        count = len(data)  # type: ignore[arg-type]
        steps = [list(range(start, min(start + batch_size, count))) for start in range(0, count, batch_size)]
        return _loader_spec(data, steps, default_collate, 0, max_samples, select_input, type(data).__name__)
    if isinstance(data, (dict, str, bytes)) or not hasattr(data, "__iter__"):
        raise SpecError(
            f"data of type {type(data).__name__} is not a DataLoader, Dataset, iterable of batches or path",
            field="data",
        )
    if batch_size is not None:
        raise SpecError("batch_size goes with a Dataset: an iterable's own batches are the steps", field="batch_size")
    return _materialised(data, max_samples, select_input, f"{type(data).__name__} of batches")


def first_batch(spec: LoaderSpec) -> Any:
    """Up to :data:`PROBE_SAMPLES` samples of the first step, as the ranks will see batches."""
    if spec.kind == "batches":
        try:
            batch = slice_batch(spec.batches[0], 0, min(spec.sizes[0], PROBE_SAMPLES))
        except DatasetError:  # one that cannot be split (refused where it must be): probed whole
            batch = spec.batches[0]
    else:
        batch = spec.collate_fn([spec.dataset[i] for i in spec.indices[0][:PROBE_SAMPLES]])
    return batch


def _loader_spec(
    dataset: Any, steps: list[list[int]], collate_fn: Any, num_workers: int, max_samples: int | None,
    select_input: bool, source: str,
) -> LoaderSpec:
    total = sum(len(step) for step in steps)
    kept: list[tuple[int, ...]] = []
    left = max_samples if max_samples is not None else total
    for step in steps:
        if left <= 0:
            break
        if step:
            kept.append(tuple(int(i) for i in step[:left]))
            left -= len(kept[-1])
    if not kept:
        raise DatasetError(f"the calibration data ({source}) holds no samples")
    spec = LoaderSpec(
        kind="loader", sizes=tuple(len(step) for step in kept), sample_shape=(), total_samples=total, source=source,
        select_input=select_input, dataset=dataset, collate_fn=collate_fn, indices=tuple(kept),
        num_workers=int(num_workers),
    )
    shape = sample_shape(first_batch(spec), select_input)
    return replace(spec, sample_shape=shape)


def _materialised(data: Any, max_samples: int | None, select_input: bool, source: str) -> LoaderSpec:
    batches: list[Any] = []
    sizes: list[int] = []
    total = 0
    for batch in data:
        size = batch_length(batch)
        total += size
        if size == 0:
            continue
        if max_samples is not None and sum(sizes) + size > max_samples:
            size = max_samples - sum(sizes)
            batch = slice_batch(batch, 0, size)
        batches.append(batch)
        sizes.append(size)
        if max_samples is not None and sum(sizes) >= max_samples:
            break
    if not batches:
        raise DatasetError(f"the calibration data ({source}) holds no samples")
    return LoaderSpec(
        kind="batches", sizes=tuple(sizes), sample_shape=sample_shape(batches[0], select_input),
        total_samples=total, source=source, select_input=select_input, batches=tuple(batches),
    )
