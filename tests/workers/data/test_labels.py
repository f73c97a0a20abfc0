"""Which evaluation data is labelled, which may be unlabelled, and which must carry labels
(docs/evaluation.md, "Evaluation data"), on shards as webdataset's ``ShardWriter`` writes them."""

from __future__ import annotations

import numpy as np
import pytest

from bnrecal.errors import DatasetError
from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset, read_labels

from tests.ecosystem import shard_writer
from tests.shards import photos, write_folder

pytest.importorskip("webdataset")


def labels_of(source, tmp_path):
    return read_labels(describe_dataset(
        source, ReadOptions(order="given", role="evaluation data"), DataAccess(unpack_root=tmp_path / "u"),
    ))


def test_shards_with_a_class_per_sample_are_labelled(tmp_path):
    items = photos(6, size=32)
    shard_writer(tmp_path / "wds", items, 4)
    assert labels_of(tmp_path / "wds", tmp_path).tolist() == [label for _, _, label in items]


def test_shards_without_labels_are_refused_saying_what_evaluation_data_may_be_unlabelled(tmp_path):
    shard_writer(tmp_path / "wds", photos(6, size=32), 4, labels=False)
    with pytest.raises(DatasetError) as refused:
        labels_of(tmp_path / "wds", tmp_path)
    assert str(refused.value) == (
        "evaluation data: shard train-000000.tar has no labels: no 000000.cls; give each sample a KEY.cls member "
        "holding its class (evaluation shards need every sample's class; unlabelled evaluation data is an .npy, "
        "an .npz without y or images without class folders)"
    )


def test_unlabelled_images_and_arrays_evaluate_without_labels(tmp_path):
    items = photos(4, size=32)
    assert labels_of(write_folder(tmp_path / "flat", items, class_folders=False), tmp_path) is None
    np.save(tmp_path / "x.npy", np.zeros((4, 3, 8, 8), np.float32))
    assert labels_of(tmp_path / "x.npy", tmp_path) is None
    # One tar of bare KEY.jpg members is an archive of images (docs/data.md, "WebDataset"): unlabelled.
    (shard,) = shard_writer(tmp_path / "one", items, 10, labels=False)
    assert labels_of(shard, tmp_path) is None
