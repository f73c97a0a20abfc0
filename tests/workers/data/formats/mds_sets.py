"""The MDS tests' datasets, written once per test run by MosaicML Streaming's own ``MDSWriter``
(and ``merge_index``) from the same photos as a folder, and how the tests read them."""

from __future__ import annotations

import shutil
from pathlib import Path

from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset, read_labels

from tests.shards import folder_order, photos, write_folder
from tests.streaming_writer import MdsSet, write_mds

TRANSFORM = {"resize": 24, "crop": 24}
ENCODINGS = ("bytes", "jpeg", "png", "pil")
CODECS = ("zstd", "gz", "bz2")  # Streaming's compressions read here


def write_sets(root: Path) -> dict[str, Path]:
    """Every dataset the MDS tests read, written by Streaming under ``root``, and the folder of the same photos."""
    items = photos(40, size=32)
    ordered = folder_order(items)
    write_folder(root / "folder", items)
    sets = [MdsSet(root / encoding, ordered, encoding, size_limit=12_000) for encoding in ENCODINGS]  # several shards
    sets += [MdsSet(root / "unlabelled", ordered[:8], "jpeg", labels=False),
             *(MdsSet(root / codec, ordered, "jpeg", size_limit=12_000, compression=codec) for codec in CODECS),
             MdsSet(root / "br", ordered[:8], "jpeg", compression="br"),
             MdsSet(root / "named", ordered, "png", image_name="photo", label_name="klass"),
             MdsSet(root / "hashed", ordered, "jpeg", size_limit=12_000, compression="zstd", hashes=("sha1", "xxh64")),
             MdsSet(root / "hashed-raw", ordered, "jpeg", size_limit=12_000, hashes=("sha256",)),
             MdsSet(root / "merged", ordered, "jpeg", size_limit=12_000, parts=2)]
    write_mds(*sets)
    return {"folder": root / "folder"} | {one.folder.name: one.folder for one in sets}


def read(source: Path | str, tmp_path: Path, endpoint: str | None = None, **options: object):
    spec = describe_dataset(source, ReadOptions(transform=TRANSFORM, **options),
                            DataAccess(unpack_root=tmp_path / "u", endpoint_url=endpoint))
    with spec.open() as data:
        return spec, data.load(0, len(data)), read_labels(spec)


def changed_copy(folder: Path, tmp_path: Path) -> Path:
    """A copy of an MDS folder, to change."""
    return Path(shutil.copytree(folder, tmp_path / f"{folder.name}-changed"))
