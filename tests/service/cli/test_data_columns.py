"""`--image-column` and `--label-column` name the columns of Parquet data, for `--data` and
`--eval-data` alike; a column name that names no column exits 2 naming the option by its flag,
as typed (the job spec and the Python API name it ``image_column``)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import run_cli, save_state
from tests.nets import classifier_net, perturbed
from tests.shards import folder_order, photos, write_folder

pytestmark = pytest.mark.usefixtures("cli_environment")


@pytest.fixture(scope="module")
def columns(tmp_path_factory):
    """The same 12 photos as a folder and as Parquet with two image columns (``img``, the
    photos, and ``thumb``) and the labels in ``klass``."""
    root = tmp_path_factory.mktemp("columns")
    items = folder_order(photos(12, size=32))
    write_folder(root / "folder", items)
    thumbs = photos(12, size=24, seed=4)
    pq.write_table(pa.table({
        "thumb": [data for _, data, _ in thumbs], "img": [data for _, data, _ in items],
        "klass": pa.array([label for _, _, label in items], type=pa.int64()),
    }), root / "photos.parquet")
    torch.manual_seed(2)
    return {"root": root, "checkpoint": save_state(root / "m.pt", perturbed(classifier_net(3)))}


def calibrate(capsys, columns, tmp_path, data, *extra):
    return run_cli(
        capsys, "calibrate", "--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 3}',
        "--checkpoint", str(columns["checkpoint"]), "--data", str(columns["root"] / data),
        "--transform", '{"resize": 20, "crop": 16}', "--batch-size", "4", "--order", "given",
        "--out", str(tmp_path / "out.pt"), "--report", str(tmp_path / "r.json"), *extra,
    )


def test_named_columns_calibrate_and_evaluate_as_the_folder(capsys, columns, tmp_path):
    code, _, err = calibrate(capsys, columns, tmp_path, "folder", "--eval-data", str(columns["root"] / "folder"))
    assert code == 0, err
    folder = json.loads((tmp_path / "r.json").read_text())
    code, _, err = calibrate(
        capsys, columns, tmp_path, "photos.parquet", "--eval-data", str(columns["root"] / "photos.parquet"),
        "--image-column", "img", "--label-column", "klass",
    )
    assert code == 0, err
    parquet = json.loads((tmp_path / "r.json").read_text())
    assert [layer["mean_shift"] for layer in parquet["layers"]] == [layer["mean_shift"] for layer in folder["layers"]]
    assert parquet["evaluation"]["after"]["top1"] == folder["evaluation"]["after"]["top1"]
    # A folder beside Parquet evaluation data: the column options name the Parquet's columns.
    code, _, err = calibrate(
        capsys, columns, tmp_path, "folder", "--eval-data", str(columns["root"] / "photos.parquet"),
        "--image-column", "img", "--label-column", "klass",
    )
    assert code == 0, err


@pytest.mark.parametrize(("args", "named"), [
    (["--image-column", "img"], "--image-column names a Parquet, Arrow or MDS column; neither"),  # no Parquet at all
    (["--label-column", "klass"], "--label-column names the labels of Parquet, Arrow or MDS evaluation data; there is no"),
    (["--image-column", ""], "--image-column: String should have at least 1 character"),
])
def test_a_column_that_names_nothing_exits_2_naming_the_option(capsys, columns, tmp_path, args, named):
    code, _, err = calibrate(capsys, columns, tmp_path, "folder", *args)
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.pt").exists()


def test_evaluation_parquet_without_its_label_column_names_the_columns_and_the_flag(capsys, columns, tmp_path):
    code, _, err = calibrate(
        capsys, columns, tmp_path, "folder", "--eval-data", str(columns["root"] / "photos.parquet"),
        "--image-column", "img",
    )
    assert code == 2 and err == (
        "error: evaluation data: photos.parquet has no label column 'label' (columns: thumb, img, klass); "
        "set --label-column to its column of integer classes (integer columns: klass)\n"
    ), err


def test_a_missing_image_column_names_the_columns_of_bytes_and_the_flag(capsys, columns, tmp_path):
    code, _, err = calibrate(capsys, columns, tmp_path, "photos.parquet", "--image-column", "picture")
    assert code == 2 and err == (
        "error: photos.parquet has no image column 'picture' (columns: thumb, img, klass); "
        "set --image-column to the one holding the images (columns of bytes: thumb, img)\n"
    ), err
