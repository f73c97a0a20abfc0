"""Errors that say what to do (issue 33): a near miss of a model source is a suggestion; a
checkpoint that does not fit names arch or model_kwargs (with the num_classes its head
implies); data of the wrong layout says what the model takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from bnrecal.errors import ArchitectureError, CheckpointError, ModelInputError
from bnrecal.workers.models.architectures import build_model, check_architecture
from bnrecal.workers.models.checkpoints import load_checkpoint, load_into_model
from bnrecal.workers.models.model_check import check_checkpoint_fits, check_data_fits
from bnrecal.workers.suggestions import sample_shape_hint

from tests.workers.models.model_zoo import small_cnn

LIMIT = 2**31
ZOO = "tests.workers.models.model_zoo"


@pytest.mark.parametrize("arch, suggestion", [
    ("torchvison:resnet18", "did you mean torchvision:resnet18?"),
    ("Torchvision:resnet18", "did you mean torchvision:resnet18?"),
    ("tim:resnet18", "did you mean timm:resnet18?"),
    ("transformer:ResNetModel", "did you mean transformers:ResNetModel?"),
])
def test_a_near_miss_of_a_known_source_is_a_suggestion_not_an_allowlist_error(arch, suggestion):
    with pytest.raises(ArchitectureError) as info:
        check_architecture(arch, ["tests"])
    assert suggestion in str(info.value) and "BNRECAL_MODEL_MODULES" not in str(info.value)


def test_a_near_miss_of_an_allowed_module_suggests_it():
    with pytest.raises(ArchitectureError) as info:
        check_architecture("test.workers.models.model_zoo:small_cnn", ["tests"])
    assert f"did you mean {ZOO}:small_cnn?" in str(info.value)
    with pytest.raises(ArchitectureError) as info:
        check_architecture("os:getcwd", ["tests"])
    assert "did you mean" not in str(info.value) and "BNRECAL_MODEL_MODULES" in str(info.value)


def save(path: Path, model: torch.nn.Module) -> Path:
    save_file({key: value.contiguous() for key, value in model.state_dict().items()}, str(path))
    return path


def both_checks(arch: str, kwargs: dict, checkpoint: Path) -> list[CheckpointError]:
    """The submission's check (shapes only, on meta) and the rank's load: the same error."""
    errors = []
    with pytest.raises(CheckpointError) as info:
        check_checkpoint_fits(arch, kwargs, checkpoint, allowed_modules=("tests",), max_bytes=LIMIT)
    errors.append(info.value)
    with pytest.raises(CheckpointError) as info:
        load_into_model(build_model(arch, kwargs, allowed_modules=("tests",)), load_checkpoint(checkpoint))
    errors.append(info.value)
    return errors


def test_a_head_of_another_size_suggests_num_classes(tmp_path):
    checkpoint = save(tmp_path / "ten.safetensors", torchvision.models.resnet18(num_classes=10))
    for error in both_checks("torchvision:resnet18", {}, checkpoint):
        assert "fc.weight (10, 512) vs model (1000, 512)" in error.message
        assert "the checkpoint has 10 classes, the model 1000" in error.message
        assert """--model-kwargs '{"num_classes": 10}'""" in error.message and error.field == "model_kwargs"


def test_a_checkpoint_of_another_architecture_says_check_arch(tmp_path):
    checkpoint = save(tmp_path / "mobilenet.safetensors", torchvision.models.mobilenet_v3_small(num_classes=10))
    for error in both_checks("torchvision:resnet18", {"num_classes": 10}, checkpoint):
        assert "looks like another architecture's; check arch (--arch)" in error.message
        assert error.field == "arch" and "\n" not in error.message and len(error.message) < 700


def test_layers_of_another_width_say_check_model_kwargs(tmp_path):
    checkpoint = save(tmp_path / "wide.safetensors", small_cnn(width=16))
    for error in both_checks(f"{ZOO}:small_cnn", {}, checkpoint):
        assert "layer sizes differ: check model_kwargs (--model-kwargs)" in error.message
        assert error.field == "model_kwargs"


@pytest.mark.parametrize("shape, hint", [
    ((16, 16, 3), "it takes (3, H, W); your data looks channels-last: transpose it to channels-first, "
                  "e.g. x.transpose(0, 3, 1, 2)"),
    ((1, 16, 16), "it takes (3, H, W), these have 1 channel"),
    ((16, 16), "it takes (3, H, W)"),
    ((3, 16, 16), ""),
])
def test_sample_shape_hints_name_what_the_model_takes(shape, hint):
    assert sample_shape_hint(torchvision.models.resnet18(), shape) == hint


def test_sample_shape_hints_for_one_channel_3d_and_linear_models():
    assert sample_shape_hint(torch.nn.Conv2d(1, 4, 3), (28, 28)).endswith("add the channel axis, e.g. x[:, None]")
    volume = torch.nn.Sequential(torch.nn.Conv3d(3, 4, 3))
    assert "(3, D, H, W)" in sample_shape_hint(volume, (8, 16, 16, 3)) and "x.transpose(0, 4, 1, 2, 3)" in (
        sample_shape_hint(volume, (8, 16, 16, 3)))
    assert sample_shape_hint(torch.nn.Linear(64, 4), (20,)) == "its first layer takes 64 features in the last dimension"
    assert sample_shape_hint(torch.nn.ReLU(), (3, 4)) == ""


def test_data_the_model_rejects_is_refused_on_the_meta_device():
    with pytest.raises(ModelInputError) as info:
        check_data_fits("torchvision:resnet18", {}, (16, 16, 3), name="calib.npy")
    assert info.value.field == "data" and str(info.value).startswith(
        "data 'calib.npy': the model rejects samples of shape (16, 16, 3): it takes (3, H, W); your data looks channels-last"
    )
    check_data_fits("torchvision:resnet18", {}, (3, 16, 16))  # fits: nothing to say
    check_data_fits("torchvision:resnet18", {}, None)  # images: known only once read
