"""Real photos written as the formats users bring: an image folder (class folders), WebDataset
tar shards (``KEY.jpg`` + ``KEY.cls``, optionally gzip), Parquet files as Hugging Face writes
them (an ``image`` column of ``{bytes, path}`` structs and a ``label`` column, row groups of
100), and a ``datasets`` ``save_to_disk`` folder (written with pyarrow the way ``datasets``
writes it: ``data-00000-of-00001.arrow`` in the IPC stream format, ``state.json``,
``dataset_info.json``; the ``datasets`` package is not installed here).

The photos are crops of the two sample images that ship with scikit-learn
(``load_sample_images``), recoloured per crop, encoded as JPEG once: every format holds
the very same bytes, in the same order (the folder's sorted path order).
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image


def photos(
    count: int, size: int = 64, seed: int = 0, classes: int = 3, subsampling: str = "4:2:0"
) -> list[tuple[str, bytes, int]]:
    """``count`` JPEG photos ``(name, bytes, label)``, in sorted name order; the label is
    which class a crop was assigned (round robin). ``subsampling`` is the JPEG's chroma
    subsampling: PIL's default ``4:2:0``, as most photos have, or ``4:4:4``."""
    from sklearn.datasets import load_sample_images

    images = load_sample_images().images
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        image = images[i % len(images)]
        crop = int(rng.integers(size, min(image.shape[:2])))
        top = int(rng.integers(0, image.shape[0] - crop))
        left = int(rng.integers(0, image.shape[1] - crop))
        gains = rng.uniform(0.6, 1.4, size=3)
        patch = np.clip(image[top : top + crop, left : left + crop] * gains, 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(patch).resize((size, size), Image.BILINEAR).save(buffer, format="JPEG", quality=90, subsampling=subsampling)
        out.append((f"{i:06d}", buffer.getvalue(), i % classes))
    return out


def write_folder(folder: Path, items: list[tuple[str, bytes, int]], *, class_folders: bool = True) -> Path:
    """An image folder: ``c<label>/<name>.jpg`` (sorted path order = class, then name), or flat."""
    for name, data, label in items:
        path = folder / (f"c{label}/{name}.jpg" if class_folders else f"{name}.jpg")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return folder


def folder_order(items: list[tuple[str, bytes, int]], class_folders: bool = True) -> list[tuple[str, bytes, int]]:
    """The items in the order a folder of them is read (sorted relative path)."""
    return sorted(items, key=lambda item: (f"c{item[2]}/" if class_folders else "") + item[0])


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def write_tar_shards(
    folder: Path, items: list[tuple[str, bytes, int]], per_shard: int, *, gz: bool = False, labels: bool = True,
    extra: bool = True, prefix: str = "train",
) -> list[Path]:
    """WebDataset shards ``prefix-000000.tar`` ...: per sample ``KEY.jpg``, ``KEY.cls`` and a
    ``KEY.json`` (ignored), in the items' order."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard, start in enumerate(range(0, len(items), per_shard)):
        path = folder / f"{prefix}-{shard:06d}.tar{'.gz' if gz else ''}"
        with tarfile.open(path, "w:gz" if gz else "w", format=tarfile.USTAR_FORMAT) as tar:
            for name, data, label in items[start : start + per_shard]:
                key = f"{name}_{label}"
                if labels:
                    _add(tar, f"{key}.cls", str(label).encode())
                _add(tar, f"{key}.jpg", data)
                if extra:
                    _add(tar, f"{key}.json", json.dumps({"name": name}).encode())
        paths.append(path)
    return paths


def write_parquet(
    folder: Path, items: list[tuple[str, bytes, int]], per_file: int, *, row_group: int = 100, labels: bool = True,
    binary: bool = False, image_column: str = "image",
) -> list[Path]:
    """Parquet files ``data/train-0000i-of-0000n.parquet`` as the Hub lays them out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = folder / "data"
    folder.mkdir(parents=True, exist_ok=True)
    chunks = [items[i : i + per_file] for i in range(0, len(items), per_file)]
    paths = []
    for index, chunk in enumerate(chunks):
        table = _table(chunk, labels, binary, image_column)
        path = folder / f"train-{index:05d}-of-{len(chunks):05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group)
        paths.append(path)
    return paths


def _table(items: list[tuple[str, bytes, int]], labels: bool, binary: bool, image_column: str) -> object:
    import pyarrow as pa

    if binary:
        images = pa.array([data for _, data, _ in items], type=pa.binary())
    else:
        images = pa.array([{"bytes": data, "path": f"{name}.jpg"} for name, data, _ in items],
                          type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    columns = {image_column: images}
    if labels:
        columns["label"] = pa.array([label for _, _, label in items], type=pa.int64())
    return pa.table(columns)


def write_save_to_disk(folder: Path, items: list[tuple[str, bytes, int]], batch: int = 100) -> Path:
    """A ``save_to_disk`` folder as ``datasets`` writes one: Arrow IPC stream, batches of ``batch`` rows."""
    import pyarrow as pa

    folder.mkdir(parents=True, exist_ok=True)
    table = _table(items, True, False, "image")
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        for start in range(0, len(items), batch):
            writer.write_table(table.slice(start, batch))
    (folder / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "0", "_format_type": None,
        "_split": "train",
    }))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {
        "image": {"_type": "Image"}, "label": {"dtype": "int64", "_type": "Value"},
    }}))
    return folder
