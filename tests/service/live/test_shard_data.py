"""The Python API takes shards as data: a list of shard paths (or URIs) reads as the same
photos in a folder, in the list's order."""

from __future__ import annotations

import copy

import torch

import bnrecal

from tests.nets import classifier_net, perturbed
from tests.shards import folder_order, photos, write_folder, write_tar_shards


def test_a_list_of_shards_calibrates_as_the_folder(tmp_path, monkeypatch):
    items = photos(40, size=32)
    write_folder(tmp_path / "folder", items)
    tars = write_tar_shards(tmp_path / "wds", folder_order(items), 16)
    monkeypatch.setenv("BNRECAL_DATA_DIR", str(tmp_path / "data"))  # where the shards are unpacked
    model = perturbed(classifier_net(3))
    twin = copy.deepcopy(model)
    report = bnrecal.recalibrate(
        model, [str(path) for path in tars], batch_size=8, progress=False, order="given"
    )
    bnrecal.recalibrate(twin, tmp_path / "folder", batch_size=8, progress=False, order="given")
    assert report["samples"] == 40 and report["dataset"]["kind"] == "shards"
    assert torch.equal(model.bn.running_mean, twin.bn.running_mean)
    assert torch.equal(model.bn.running_var, twin.bn.running_var)
    assert not torch.equal(model.bn.running_var, perturbed(classifier_net(3)).bn.running_var)


def two_image_columns(path, items, other):
    """A Parquet file with two columns of image bytes: ``img`` (the photos) and ``thumb``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"thumb": [data for _, data, _ in other], "img": [data for _, data, _ in items]}), path)
    return path


def test_parquet_with_its_image_column_named_calibrates_as_the_folder(tmp_path, monkeypatch):
    import pytest

    from bnrecal import DatasetError, SpecError

    items = folder_order(photos(12, size=32))
    write_folder(tmp_path / "folder", items)
    parquet = two_image_columns(tmp_path / "photos.parquet", items, photos(12, size=24, seed=2))
    monkeypatch.setenv("BNRECAL_DATA_DIR", str(tmp_path / "data"))  # where the shards are unpacked
    model = perturbed(classifier_net(3))
    twin = copy.deepcopy(model)
    options = {"batch_size": 4, "progress": False, "order": "given"}
    bnrecal.recalibrate(model, parquet, image_column="img", **options)
    bnrecal.recalibrate(twin, tmp_path / "folder", **options)
    assert torch.equal(model.bn.running_var, twin.bn.running_var)
    with pytest.raises(DatasetError, match="image_column"):  # two image columns: which one?
        bnrecal.recalibrate(copy.deepcopy(twin), parquet, **options)
    with pytest.raises(SpecError, match="image_column") as refused:
        bnrecal.recalibrate(copy.deepcopy(twin), tmp_path / "folder", image_column="img", **options)
    assert refused.value.field == "image_column"
