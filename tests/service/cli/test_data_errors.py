"""Data that cannot be read as given fails ``bnrecal calibrate`` with exit 2 and one line that
says what to give instead (docs/data.md): a saved DatasetDict, a glob, Parquet image cells
holding only paths, evaluation shards without labels; data written by ``datasets`` and
webdataset's ``ShardWriter``. Run options are named by the flags typed, never by the field
names of the job spec and the Python API."""

from __future__ import annotations

import pytest
import torch

from bnrecal.errors import CheckpointError, DatasetOptionError, SpecError
from bnrecal.service.cli.options import flag_message

from tests.conftest import run_cli, save_state
from tests.ecosystem import path_only_parquet, save_dataset_dict, shard_writer
from tests.nets import classifier_net, perturbed
from tests.shards import photos, write_folder, write_parquet

pytestmark = pytest.mark.usefixtures("cli_environment")


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(2)
    return save_state(tmp_path / "m.pt", perturbed(classifier_net(3)))


def calibrate(capsys, checkpoint, tmp_path, data, *extra):
    return run_cli(
        capsys, "calibrate", "--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 3}',
        "--checkpoint", str(checkpoint), "--data", str(data), "--transform", '{"resize": 20, "crop": 16}',
        "--batch-size", "4", "--out", str(tmp_path / "out.pt"), *extra,
    )


def refused(result: tuple[int, str, str]) -> str:
    """The one error line of a command that exited 2 (bad input) and printed nothing else."""
    code, out, err = result
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    return err[len("error: "):].rstrip("\n")


def test_a_saved_dataset_dict_names_its_splits_and_a_split_to_give(capsys, checkpoint, tmp_path):
    pytest.importorskip("datasets")
    items = photos(8, size=32)
    folder = save_dataset_dict(tmp_path / "photos", {"train": items[:6], "test": items[6:]})
    assert refused(calibrate(capsys, checkpoint, tmp_path, folder)) == (
        "photos holds a DatasetDict with splits train, test, not one dataset: give one split's folder as the "
        "calibration data, e.g. photos/train"
    )
    line = refused(calibrate(capsys, checkpoint, tmp_path, folder / "train", "--eval-data", folder))
    assert line.endswith("give one split's folder as the evaluation data, e.g. photos/train")
    code, _, err = calibrate(capsys, checkpoint, tmp_path, folder / "train", "--eval-data", folder / "test")
    assert code == 0 and "top-1" in err, err


def test_a_glob_is_not_expanded_and_the_brace_pattern_of_its_matches_is_given(capsys, checkpoint, tmp_path):
    write_parquet(tmp_path, photos(9, size=32), 3)
    glob = f"{tmp_path}/data/train-*.parquet"
    assert refused(calibrate(capsys, checkpoint, tmp_path, glob)) == (
        f"--data {glob}: no such file or directory; globs (*, ?, [...]) are not expanded: give its 3 matches as "
        f"the brace pattern '{tmp_path}/data/train-{{00000..00002}}-of-00003.parquet'"
    )
    code, _, err = calibrate(capsys, checkpoint, tmp_path, f"{tmp_path}/data/train-{{00000..00002}}-of-00003.parquet")
    assert code == 0, err


def test_parquet_image_cells_holding_only_paths_say_how_to_embed_the_images(capsys, checkpoint, tmp_path):
    pytest.importorskip("datasets")
    path_only_parquet(tmp_path / "paths.parquet", photos(4, size=32))
    line = refused(calibrate(capsys, checkpoint, tmp_path, tmp_path / "paths.parquet"))
    assert line.startswith(f"paths.parquet: row 0 of column 'image' holds only a path ({tmp_path}/paths-files/")
    assert "embed the images in the file, e.g. with datasets: ds.with_format('arrow')" in line


def test_evaluation_shards_without_labels_say_what_may_be_unlabelled(capsys, checkpoint, tmp_path):
    pytest.importorskip("webdataset")
    items = photos(8, size=32)
    shard_writer(tmp_path / "wds", items, 4, labels=False)
    line = refused(calibrate(capsys, checkpoint, tmp_path, tmp_path / "wds", "--eval-data", tmp_path / "wds"))
    assert line == (
        "evaluation data: shard train-000000.tar has no labels: no 000000.cls; give each sample a KEY.cls member "
        "holding its class (evaluation shards need every sample's class; unlabelled evaluation data is an .npy, "
        "an .npz without y or images without class folders)"
    )
    flat = write_folder(tmp_path / "flat", items, class_folders=False)  # what it says works: prediction change only
    code, _, err = calibrate(capsys, checkpoint, tmp_path, tmp_path / "wds", "--eval-data", flat)
    assert code == 0 and "(no labels)" in err, err


def blaming(error: CheckpointError, field: str) -> CheckpointError:
    """``error`` blaming ``field``, as the checkpoint check sets it on the error it raises."""
    error.field = field
    return error


@pytest.mark.parametrize(("error", "line"), [
    (DatasetOptionError("image_column and label_column apply to Parquet, Arrow and MDS shards; calib.npy is not",
                        field="image_column"),
     "--image-column and --label-column apply to Parquet, Arrow and MDS shards; calib.npy is not"),
    (SpecError("seed must be an integer >= 0, got -1", field="seed"), "--seed must be an integer >= 0, got -1"),
    (SpecError("transform.crop: must be at most resize", field="transform.crop"), "--transform.crop: must be at most resize"),
    # The blamed option's word elsewhere is prose; a column named like an option is quoted; a flag stays a flag.
    (SpecError("order must be one of shuffled, given; the data's order", field="order"),
     "--order must be one of shuffled, given; the data's order"),
    (DatasetOptionError("x.parquet has no label column 'label_column' (give label_column)", field="label_column"),
     "x.parquet has no label column 'label_column' (give --label-column)"),
    (SpecError("--int8 sets the INT8 export's options", field="--int8"), "--int8 sets the INT8 export's options"),
    (DatasetOptionError("no image_column here", field=None), "no image_column here"),  # blames no option
    # A hint that names the field and its flag (for the job spec and the CLI alike) names the flag once here.
    (blaming(CheckpointError("""only the classifier head differs; set model_kwargs {"num_classes": 3} (--model-kwargs '{"num_classes": 3}')"""),
             "model_kwargs"),
     """only the classifier head differs; set --model-kwargs '{"num_classes": 3}'"""),
])
def test_errors_name_run_options_by_their_flags(error, line):
    assert flag_message(error) == line
