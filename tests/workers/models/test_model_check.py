"""The submission-time model check: shapes and size from the meta device and the
checkpoint's header, never the weights themselves."""

from __future__ import annotations

import time

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from bnrecal.errors import CheckpointError, SpecError
from bnrecal.workers.models.architectures import build_model
from bnrecal.workers.models.checkpoints import load_checkpoint, load_into_model
from bnrecal.workers.models.model_check import check_checkpoint_fits, checkpoint_shapes, model_layout

from tests.wrappers import lightning_checkpoint

GIB = 2**30


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def resnet18_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model-check")
    state = torchvision.models.resnet18(weights=None, num_classes=10).state_dict()
    torch.save(state, folder / "r18.pt")
    save_file(state, folder / "r18.safetensors")
    return folder


@pytest.mark.parametrize("name", ["r18.pt", "r18.safetensors"])
def test_a_matching_checkpoint_fits(resnet18_files, name):
    check_checkpoint_fits("torchvision:resnet18", {"num_classes": 10}, resnet18_files / name, max_bytes=GIB)
    shapes = checkpoint_shapes(resnet18_files / name)
    assert shapes["fc.weight"] == (10, 512) and len(shapes) == 122


def test_a_wrapped_checkpoint_fits_through_its_prefix(resnet18_files, tmp_path):
    path = tmp_path / "lightning.ckpt"
    torch.save(lightning_checkpoint(torchvision.models.resnet18(weights=None, num_classes=10), "model"), path)
    check_checkpoint_fits("torchvision:resnet18", {"num_classes": 10}, path, max_bytes=GIB)


def test_ten_million_classes_are_refused_without_allocating(resnet18_files):
    before = resident_bytes()
    started = time.perf_counter()
    with pytest.raises(SpecError, match="BNRECAL_MAX_MODEL_BYTES") as refused:
        check_checkpoint_fits("torchvision:resnet18", {"num_classes": 10**7}, resnet18_files / "r18.pt", max_bytes=4 * GIB)
    assert refused.value.field == "model_kwargs" and "19.2 GiB" in str(refused.value)
    with pytest.raises(CheckpointError, match=r"fc.weight \(10, 512\) vs model \(10000000, 512\)"):
        check_checkpoint_fits("torchvision:resnet18", {"num_classes": 10**7}, resnet18_files / "r18.pt", max_bytes=64 * GIB)
    assert time.perf_counter() - started < 1.0
    assert resident_bytes() - before < 64 * 2**20  # 10^7 x 512 float32 would be 19 GiB


def test_a_mismatch_is_the_error_loading_gives(resnet18_files):
    with pytest.raises(CheckpointError) as checked:
        check_checkpoint_fits("torchvision:resnet18", {"num_classes": 12}, resnet18_files / "r18.pt", max_bytes=GIB)
    model = build_model("torchvision:resnet18", {"num_classes": 12})
    with pytest.raises(CheckpointError) as loaded:
        load_into_model(model, load_checkpoint(resnet18_files / "r18.pt"))
    assert str(checked.value) == str(loaded.value)


def test_meta_layout_is_the_real_model_layout():
    keys, shapes = model_layout("timm:efficientnet_b0", {"num_classes": 7}, (), GIB)
    real = build_model("timm:efficientnet_b0", {"num_classes": 7}).state_dict()
    assert shapes == {key: tuple(value.shape) for key, value in real.items()}
    assert keys.expected == list(real)


def test_an_architecture_the_meta_device_cannot_build_is_checked_in_a_bounded_child(tmp_path):
    # torchvision's RegNet computes its widths from tensor values while it is built.
    path = tmp_path / "regnet.pt"
    torch.save(torchvision.models.regnet_y_400mf(weights=None, num_classes=10).state_dict(), path)
    before = resident_bytes()
    with pytest.raises(CheckpointError, match="shape mismatches: fc.weight"):
        check_checkpoint_fits("torchvision:regnet_y_400mf", {"num_classes": 11}, path, max_bytes=GIB)
    with pytest.raises(SpecError, match="BNRECAL_MAX_MODEL_BYTES"):  # the child is stopped at the bound
        check_checkpoint_fits("torchvision:regnet_y_400mf", {"num_classes": 10**6}, path, max_bytes=256 * 2**20)
    assert resident_bytes() - before < 64 * 2**20


def test_unknown_kwargs_are_refused_on_the_meta_device(resnet18_files):
    with pytest.raises(SpecError, match="model_kwargs do not fit"):
        check_checkpoint_fits("torchvision:resnet18", {"classes": 10}, resnet18_files / "r18.pt", max_bytes=GIB)


@pytest.mark.parametrize("arch", ["torchvision:resnet81", "timm:resnet81"])
def test_a_misspelt_architecture_is_refused_without_a_child_build(resnet18_files, monkeypatch, arch):
    """A name no source knows is not a model the meta device cannot build: it is refused at
    once with close names, never handed to a child process that builds it (6 s each)."""
    from bnrecal.errors import ArchitectureError
    from bnrecal.workers.models import model_check

    def no_child(*args, **kwargs):
        raise AssertionError("a child process was started for an unknown architecture")

    monkeypatch.setattr(model_check.subprocess, "Popen", no_child)
    with pytest.raises(ArchitectureError, match="unknown .* model 'resnet81' .*did you mean resnet18"):
        check_checkpoint_fits(arch, {}, resnet18_files / "r18.pt", max_bytes=GIB)
