"""Parquet and ``save_to_disk`` data as Hugging Face ``datasets`` itself writes it
(docs/data.md, "Parquet and Hugging Face datasets"): a saved Dataset reads as the same photos
in a folder; what cannot be read fails in one line that names the option (``image_column``,
``label_column``: the Python and HTTP names), lists what the data holds and says what to do.
"""

from __future__ import annotations

import pytest
import torch

from bnrecal.errors import DatasetError, DatasetOptionError
from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset, read_labels

from tests.ecosystem import hf_dataset, path_only_parquet, save_dataset, save_dataset_dict
from tests.shards import photos, write_folder

pytest.importorskip("datasets")

TRANSFORM = {"resize": 24, "crop": 24}


def read_all(source, tmp_path, **options):
    spec = describe_dataset(
        source, ReadOptions(transform=TRANSFORM, order="given", **options), DataAccess(unpack_root=tmp_path / "u"),
    )
    with spec.open() as data:
        return data.load(0, len(data)), spec


def test_a_saved_dataset_reads_as_the_folder_of_its_photos(tmp_path):
    items = photos(12, size=32)
    expected, _ = read_all(write_folder(tmp_path / "folder", items, class_folders=False), tmp_path)
    found, spec = read_all(save_dataset(tmp_path / "saved", items), tmp_path)
    assert spec.shards.format == "arrow" and torch.equal(found, expected)
    assert read_labels(spec).tolist() == [label for _, _, label in items]


def test_a_saved_dataset_dict_is_refused_naming_its_splits_and_a_split_to_give(tmp_path):
    items = photos(6, size=32)
    folder = save_dataset_dict(tmp_path / "photos", {"train": items[:4], "test": items[4:]})
    with pytest.raises(DatasetError) as refused:
        describe_dataset(folder, ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u"))
    assert str(refused.value) == (
        "photos holds a DatasetDict with splits train, test, not one dataset: give one split's folder as the "
        "calibration data, e.g. photos/train"
    )
    found, _ = read_all(folder / "train", tmp_path)  # the advice works
    assert len(found) == 4


def test_a_missing_label_column_names_the_columns_and_the_option(tmp_path):
    items = photos(6, size=32)
    dataset = hf_dataset(items).rename_column("label", "klass")
    dataset.to_parquet(str(tmp_path / "photos.parquet"))
    spec = describe_dataset(
        tmp_path / "photos.parquet", ReadOptions(role="evaluation data"), DataAccess(unpack_root=tmp_path / "u"),
    )
    with pytest.raises(DatasetOptionError) as refused:
        read_labels(spec)
    assert refused.value.field == "label_column"
    assert str(refused.value) == (
        "evaluation data: photos.parquet has no label column 'label' (columns: image, klass); "
        "set label_column to its column of integer classes (integer columns: klass)"
    )
    spec = describe_dataset(
        tmp_path / "photos.parquet", ReadOptions(label_column="klass"), DataAccess(unpack_root=tmp_path / "u"),
    )
    assert read_labels(spec).tolist() == [label for _, _, label in items]  # the advice works


def test_shards_without_an_integer_column_say_what_evaluation_data_can_be_unlabelled(tmp_path):
    hf_dataset(photos(4, size=32)).remove_columns("label").to_parquet(str(tmp_path / "photos.parquet"))
    spec = describe_dataset(
        tmp_path / "photos.parquet", ReadOptions(role="evaluation data"), DataAccess(unpack_root=tmp_path / "u"),
    )
    with pytest.raises(DatasetOptionError, match=r"\(columns: image\); it has no integer column to take the classes "
                       r"from: evaluation shards need every sample's class; unlabelled evaluation data is an \.npy"):
        read_labels(spec)


def test_a_missing_image_column_names_the_columns_of_bytes_and_the_option(tmp_path):
    dataset = hf_dataset(photos(4, size=32)).rename_column("image", "photo")
    dataset.to_parquet(str(tmp_path / "photos.parquet"))
    with pytest.raises(DatasetOptionError) as refused:
        describe_dataset(
            tmp_path / "photos.parquet", ReadOptions(image_column="picture"), DataAccess(unpack_root=tmp_path / "u"),
        )
    assert refused.value.field == "image_column"
    assert str(refused.value) == (
        "photos.parquet has no image column 'picture' (columns: photo, label); "
        "set image_column to the one holding the images (columns of bytes: photo)"
    )


def test_image_cells_holding_only_a_path_say_how_to_embed_the_bytes(tmp_path):
    items = photos(5, size=32)
    dataset = path_only_parquet(tmp_path / "paths.parquet", items)
    with pytest.raises(DatasetError) as refused:
        describe_dataset(
            tmp_path / "paths.parquet", ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u"),
        )
    assert str(refused.value) == (
        f"paths.parquet: row 0 of column 'image' holds only a path ({tmp_path}/paths-files/000000.jpg), not the "
        "image's bytes: embed the images in the file, e.g. with datasets: ds.with_format('arrow')"
        ".map(datasets.table.embed_table_storage, batched=True).to_parquet(PATH), or give the folder "
        "ds.save_to_disk(PATH) writes"
    )
    import datasets

    # Both ways the message gives read as the photos.
    expected, _ = read_all(write_folder(tmp_path / "folder", items, class_folders=False), tmp_path)
    dataset.with_format("arrow").map(datasets.table.embed_table_storage, batched=True).to_parquet(
        str(tmp_path / "embedded.parquet")
    )
    found, _ = read_all(tmp_path / "embedded.parquet", tmp_path)
    assert torch.equal(found, expected)
    dataset.save_to_disk(str(tmp_path / "saved"))
    found, _ = read_all(tmp_path / "saved", tmp_path)
    assert torch.equal(found, expected)
