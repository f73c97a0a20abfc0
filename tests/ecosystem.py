"""Data as the ecosystem's own writers write it: Hugging Face ``datasets`` (``save_to_disk`` of
a Dataset and of a DatasetDict, ``to_parquet``) and webdataset's ``ShardWriter``, from the
photos of :mod:`tests.shards` (the very JPEG bytes, so every format reads as the folder does).

Each writer imports its package when called: a test module that uses them starts with
``pytest.importorskip`` of the package, so it skips where the test extra is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _datasets() -> Any:
    """The ``datasets`` package, its progress bars off (they would land in the tests' stderr)."""
    import datasets

    datasets.disable_progress_bars()
    return datasets


def hf_dataset(items: list[tuple[str, bytes, int]], classes: int = 3) -> Any:
    """A ``datasets.Dataset`` of the photos: an ``Image`` column holding their bytes and a
    ``ClassLabel`` column ``label``, as ``load_dataset`` of an image folder gives one."""
    datasets = _datasets()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=classes)})
    return datasets.Dataset.from_dict(
        {"image": [{"bytes": data, "path": f"{name}.jpg"} for name, data, _ in items],
         "label": [label for _, _, label in items]},
        features=features,
    )


def save_dataset(folder: Path, items: list[tuple[str, bytes, int]], num_shards: int = 1) -> Path:
    """``Dataset.save_to_disk(folder, num_shards=...)`` of the photos."""
    hf_dataset(items).save_to_disk(str(folder), num_shards=num_shards)
    return folder


def save_dataset_dict(folder: Path, splits: dict[str, list[tuple[str, bytes, int]]]) -> Path:
    """``DatasetDict.save_to_disk(folder)``: one subfolder per split and ``dataset_dict.json``."""
    _datasets().DatasetDict({split: hf_dataset(items) for split, items in splits.items()}).save_to_disk(str(folder))
    return folder


def path_only_parquet(path: Path, items: list[tuple[str, bytes, int]]) -> Any:
    """A Parquet file whose image cells hold only a path: the photos written as files, a
    Dataset of their paths cast to ``Image()``, then ``to_parquet`` (which embeds nothing).
    Returns the Dataset, to write again as the error's advice says."""
    datasets = _datasets()
    folder = path.parent / f"{path.stem}-files"
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for name, data, _ in items:
        (folder / f"{name}.jpg").write_bytes(data)
        files.append(str(folder / f"{name}.jpg"))
    dataset = datasets.Dataset.from_dict({"image": files, "label": [label for _, _, label in items]})
    dataset = dataset.cast_column("image", datasets.Image())
    dataset.to_parquet(str(path))
    return dataset


def shard_writer(folder: Path, items: list[tuple[str, bytes, int]], per_shard: int, *, labels: bool = True) -> list[Path]:
    """WebDataset shards ``train-000000.tar`` ... written by ``webdataset.ShardWriter``: per
    sample ``KEY.jpg`` and, with ``labels``, ``KEY.cls``."""
    import webdataset

    folder.mkdir(parents=True, exist_ok=True)
    with webdataset.ShardWriter(str(folder / "train-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for name, data, label in items:
            sink.write({"__key__": name, "jpg": data, **({"cls": label} if labels else {})})
    return sorted(folder.glob("train-*.tar"))
