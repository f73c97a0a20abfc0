"""The report's ``data`` part is built from a data description's typed summary
(``DataSummary.of``) and writes what the summary dicts of earlier releases wrote: the same
keys, the same values, absent fields left out (the expected dicts are those dicts' reports)."""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import pytest

from bnrecal.service.run.report.document import DataSummary
from bnrecal.workers.data import DataAccess, DatasetSummary, ReadOptions, describe_dataset
from bnrecal.workers.data.formats.loader import LoaderSpec

from tests.shards import folder_order, photos, write_folder, write_parquet, write_tar_shards

TRANSFORM = {"resize": 24, "crop": 16}
WRITTEN_TRANSFORM = {"resize": 24, "crop": 16, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
EXPECTED = {
    "npy": {"kind": "array", "source": "calib.npy", "samples": 8, "total_samples": 10, "sample_shape": [2, 3],
            "order": "given", "storage": "npy", "dtype": "<f4"},
    "npz": {"kind": "array", "source": "calib.npz", "samples": 8, "total_samples": 10, "sample_shape": [2, 3],
            "order": "given", "storage": "npz-stored", "dtype": "<f2", "array": "x"},
    "images": {"kind": "images", "source": "folder", "samples": 12, "total_samples": 12, "sample_shape": [3, 16, 16],
               "order": "shuffled", "seed": 3, "transform": WRITTEN_TRANSFORM, "classes": 3},
    "parquet": {"kind": "shards", "source": "pq", "samples": 10, "total_samples": 12, "sample_shape": [3, 16, 16],
                "order": "given", "transform": WRITTEN_TRANSFORM, "classes": 0, "format": "parquet", "shards": 3,
                "image_column": "image"},
    "webdataset": {"kind": "shards", "source": "wds", "samples": 12, "total_samples": 12, "sample_shape": [3, 16, 16],
                   "order": "given", "transform": WRITTEN_TRANSFORM, "classes": 0, "format": "webdataset", "shards": 3},
    "loader": {"kind": "loader", "source": "TensorDataset", "samples": 10, "steps": 3, "total_samples": 10,
               "sample_shape": [3, 8, 8]},
}


@pytest.fixture(scope="module")
def summaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DatasetSummary]:
    """The summary of an array of each storage, a shuffled image folder, Parquet and
    WebDataset shards of the same photos, and a DataLoader's description."""
    root = tmp_path_factory.mktemp("summaries")
    np.save(root / "calib.npy", np.zeros((10, 2, 3), np.float32))
    np.savez(root / "calib.npz", x=np.zeros((10, 2, 3), np.float16))
    items = photos(12, size=32)
    write_folder(root / "folder", items)
    write_parquet(root / "pq", folder_order(items), 5, row_group=3)
    write_tar_shards(root / "wds", folder_order(items), 5)
    access = DataAccess(unpack_root=root / "unpacked")
    specs = {
        "npy": describe_dataset(root / "calib.npy", ReadOptions(max_samples=8), access),
        "npz": describe_dataset(root / "calib.npz", ReadOptions(max_samples=8), access),
        "images": describe_dataset(
            root / "folder", ReadOptions(transform=TRANSFORM, order="shuffled", seed=3), access,
        ),
        "parquet": describe_dataset(root / "pq", ReadOptions(transform=TRANSFORM, max_samples=10), access),
        "webdataset": describe_dataset(root / "wds", ReadOptions(transform=TRANSFORM), access),
    }
    loader = LoaderSpec(kind="loader", sizes=(4, 4, 2), sample_shape=(3, 8, 8), total_samples=10, source="TensorDataset")
    return {name: spec.summary() for name, spec in specs.items()} | {"loader": loader.summary()}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_the_report_writes_what_the_summary_dicts_wrote(summaries: dict[str, DatasetSummary], name: str) -> None:
    written = DataSummary.of(summaries[name]).to_dict()
    assert written == EXPECTED[name]
    assert json.dumps(written) == json.dumps(EXPECTED[name])  # the same keys in the same order: the same bytes


def test_a_written_summary_reads_back_as_it_was(summaries: dict[str, DatasetSummary]) -> None:
    part = DataSummary.of(summaries["images"])
    assert DataSummary.model_validate(part.to_dict()) == part and part["seed"] == 3 and "steps" not in part


def test_the_summary_has_the_reports_fields(summaries: dict[str, DatasetSummary]) -> None:
    assert {f.name for f in fields(DatasetSummary)} == set(DataSummary.model_fields)
    summary = summaries["parquet"]
    assert (summary.format, summary.shards, summary.image_column, summary.seed) == ("parquet", 3, "image", None)
