"""Key prefixes of wrapped models (DDP, ``torch.compile``, Lightning), found against the
model's own keys on load and written back on save (docs/models.md, "Checkpoint layouts")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_model
from torch import nn

from bnrecal.errors import CheckpointError
from bnrecal.workers.models.checkpoint_prefix import shared_prefixes
from bnrecal.workers.models.checkpoints import load_checkpoint, load_into_model, save_checkpoint

from tests.workers.models.model_zoo import SmallCNN, TiedNet
from tests.workers.models.test_checkpoints import assert_same, bn_updates, trained_like_model
from tests.wrappers import holding, lightning_checkpoint


def compiled(model: nn.Module) -> nn.Module:
    """``torch.compile(model)``: compiling is lazy, so nothing compiles until a call."""
    return torch.compile(model)


# How each wrapper holds the model; its state_dict() is what the wrapper saves.
WRAPPERS = {
    "ddp": ("module.", lambda model: holding(model, "module")),
    "compile": ("_orig_mod.", compiled),
    "ddp-of-compiled": ("module._orig_mod.", lambda model: holding(compiled(model), "module")),
    "compiled-ddp": ("_orig_mod.module.", lambda model: compiled(holding(model, "module"))),
    "lightning-nested": ("model.backbone.", lambda model: holding(model, "model.backbone")),
}


def assert_written_back(out: Path, original: dict[str, torch.Tensor], prefix: str, updates: dict[str, Any]) -> None:
    """The saved state dict has the original keys, prefix and all, the updates in the
    stored dtypes, and every other tensor bit for bit."""
    written = torch.load(out, weights_only=True)
    assert list(written) == list(original)
    assert getattr(written, "_metadata", None) == getattr(original, "_metadata", None)
    for key, old in original.items():
        assert key.startswith(prefix)
        model_key = key.removeprefix(prefix)
        if model_key in updates:
            assert torch.equal(written[key], updates[model_key].to(old.dtype)), key
        else:
            assert_same(written[key], old, key)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_wrapper_prefix_is_stripped_on_load_and_written_back(tmp_path: Path, wrapper: str) -> None:
    prefix, wrap = WRAPPERS[wrapper]
    source = trained_like_model(5)
    state = wrap(source).state_dict()  # the real thing: torch.compile's own _orig_mod. keys
    assert all(key.startswith(prefix) for key in state) and len(state) == len(source.state_dict())
    path = tmp_path / "wrapped.pt"
    torch.save(state, path)

    checkpoint = load_checkpoint(path)
    model = SmallCNN(num_classes=3, width=4)
    load_into_model(model, checkpoint)
    assert checkpoint.prefix == prefix
    assert_same(dict(model.state_dict()), dict(source.state_dict()))

    updates = bn_updates(model)
    save_checkpoint(checkpoint, updates, tmp_path / "out.pt")
    assert_written_back(tmp_path / "out.pt", torch.load(path, weights_only=True), prefix, updates)


class VersionedNorm(nn.BatchNorm1d):
    """A BN layer that records the version torch's ``_metadata`` hands its loader."""

    loaded_version: int | None = None

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: dict[str, Any], *args: Any) -> None:
        self.loaded_version = local_metadata.get("version")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


@pytest.mark.parametrize("wrapper", ["ddp", "compile", "ddp-of-compiled", "lightning-nested"])
def test_module_versions_in_torch_metadata_reach_the_model_through_a_prefix(tmp_path: Path, wrapper: str) -> None:
    prefix, wrap = WRAPPERS[wrapper]
    state = wrap(nn.Sequential(nn.Linear(3, 4), VersionedNorm(4))).state_dict()
    state._metadata[prefix + "1"] = {"version": 1}  # an old BN, whose loader upgrades it
    torch.save(state, tmp_path / "old.pt")
    model = nn.Sequential(nn.Linear(3, 4), VersionedNorm(4))
    load_into_model(model, load_checkpoint(tmp_path / "old.pt"))
    assert model[1].loaded_version == 1  # not None: the metadata lost its prefix, not its entries


def test_lightning_checkpoint_loads_and_comes_back_in_its_own_layout(tmp_path: Path) -> None:
    source = trained_like_model(6)
    container = lightning_checkpoint(source)
    assert any(torch.is_tensor(v) for v in container["optimizer_states"][0]["state"][0].values())
    path = tmp_path / "epoch=3.ckpt"
    torch.save(container, path)

    checkpoint = load_checkpoint(path)  # optimizer tensors and all, weights only
    assert checkpoint.location == ("state_dict",)
    model = SmallCNN(num_classes=3, width=4)
    load_into_model(model, checkpoint)
    assert checkpoint.prefix == "model."
    assert_same(dict(model.state_dict()), dict(source.state_dict()))

    updates = bn_updates(model)
    out = tmp_path / "out.ckpt"
    save_checkpoint(checkpoint, updates, out)
    original, written = torch.load(path, weights_only=True), torch.load(out, weights_only=True)
    assert list(written) == list(original)
    assert_same({k: v for k, v in written.items() if k != "state_dict"}, {k: v for k, v in original.items() if k != "state_dict"})
    assert list(written["state_dict"]) == list(original["state_dict"])  # model. written back
    for key, old in original["state_dict"].items():
        model_key = key.removeprefix("model.")
        expected = updates[model_key].to(old.dtype) if model_key in updates else old
        assert_same(written["state_dict"][key], expected, key)


def test_safetensors_with_a_lightning_prefix_and_a_tied_weight_stored_once(tmp_path: Path) -> None:
    torch.manual_seed(8)
    source = TiedNet()
    path = tmp_path / "model.safetensors"
    save_model(holding(source, "model.net"), str(path), metadata={"format": "pt", "epoch": "9"})
    checkpoint = load_checkpoint(path)
    assert all(key.startswith("model.net.") for key in checkpoint.stored_state_dict)
    assert len(checkpoint.stored_state_dict) < len(source.state_dict())  # first.* or second.* only

    model = TiedNet()
    load_into_model(model, checkpoint)
    assert checkpoint.prefix == "model.net."
    assert torch.equal(model.first.weight, source.first.weight) and model.second.weight is model.first.weight

    out = tmp_path / "out.safetensors"
    save_checkpoint(checkpoint, {"bn.running_mean": torch.full((4,), 2.0)}, out)
    with safe_open(str(out), framework="pt") as handle:
        assert handle.metadata() == checkpoint.metadata and checkpoint.metadata["epoch"] == "9"
        written = {key: handle.get_tensor(key) for key in handle.keys()}
    assert sorted(written) == sorted(checkpoint.stored_state_dict)
    assert torch.equal(written["model.net.bn.running_mean"], torch.full((4,), 2.0))


def test_legacy_batchnorm_checkpoint_with_a_prefix(tmp_path: Path) -> None:
    source = trained_like_model(3)
    state = holding(source, "module").state_dict()
    for key in [k for k in state if k.endswith("num_batches_tracked")]:
        del state[key]
    torch.save({"model": state, "epoch": 90}, tmp_path / "legacy.pth")
    checkpoint = load_checkpoint(tmp_path / "legacy.pth")
    model = SmallCNN(num_classes=3, width=4)
    load_into_model(model, checkpoint)
    assert checkpoint.prefix == "module."
    assert torch.equal(model.neck_bn.running_var, source.neck_bn.running_var)
    assert int(model.neck_bn.num_batches_tracked) == 0


def test_a_model_whose_own_keys_carry_the_prefix_loads_them_as_stored(tmp_path: Path) -> None:
    """A model with a ``module`` attribute of its own: its keys are not DDP's."""
    source = holding(trained_like_model(2), "module")
    torch.save(source.state_dict(), tmp_path / "own.pt")
    checkpoint = load_checkpoint(tmp_path / "own.pt")
    model = holding(SmallCNN(num_classes=3, width=4), "module")
    load_into_model(model, checkpoint)
    assert checkpoint.prefix == ""
    assert_same(dict(model.state_dict()), dict(source.state_dict()))


def test_keys_that_only_partly_carry_a_prefix_are_not_stripped(tmp_path: Path) -> None:
    state = {
        (f"module.{key}" if index % 2 else key): value
        for index, (key, value) in enumerate(trained_like_model().state_dict().items())
    }
    torch.save(state, tmp_path / "half.pt")
    checkpoint = load_checkpoint(tmp_path / "half.pt")
    with pytest.raises(CheckpointError) as info:
        load_into_model(SmallCNN(num_classes=3, width=4), checkpoint)
    message = str(info.value)
    assert message.startswith("checkpoint does not match the architecture: ")
    assert "unexpected: module.features.1.weight" in message and "\n" not in message
    assert checkpoint.prefix == ""


def test_no_fitting_prefix_is_one_line_naming_what_was_tried(tmp_path: Path) -> None:
    state = trained_like_model().state_dict()
    del state["neck.bias"]
    state["extra.weight"] = torch.zeros(2)
    container = lightning_checkpoint(trained_like_model())
    container["state_dict"] = {f"model.net.{key}": value for key, value in state.items()}
    torch.save(container, tmp_path / "other.ckpt")
    model = SmallCNN(num_classes=3, width=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_into_model(model, load_checkpoint(tmp_path / "other.ckpt"))
    assert str(info.value) == (
        "checkpoint keys match the architecture neither as stored nor without 'model.' or 'model.net.'; "
        "closest without 'model.net.': 1 missing: neck.bias; 1 unexpected: extra.weight; "
        "check arch (--arch) for another variant of the model, and model_kwargs (--model-kwargs)"
    )
    assert_same(dict(model.state_dict()), before)  # nothing half-loaded


def test_a_shape_mismatch_behind_a_prefix_names_the_prefix(tmp_path: Path) -> None:
    torch.save(lightning_checkpoint(trained_like_model()), tmp_path / "wide.ckpt")
    with pytest.raises(CheckpointError) as info:
        load_into_model(SmallCNN(num_classes=5, width=4), load_checkpoint(tmp_path / "wide.ckpt"))
    assert str(info.value) == (
        "checkpoint does not match the architecture (keys without 'model.'): "
        "2 shape mismatches: head.weight (3, 8) vs model (5, 8), head.bias (3,) vs model (5,); "
        "only the classifier head differs: the checkpoint has 3 classes, the model 5; "
        """set model_kwargs {"num_classes": 3} (--model-kwargs '{"num_classes": 3}')"""
    )


class TwoPaths(nn.Module):
    """One BN layer reachable as ``bn`` and as ``net.bn``: each of its tensors has two keys."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.net = nn.ModuleDict({"bn": self.bn})


def test_two_fitting_prefixes_are_an_error_naming_both(tmp_path: Path) -> None:
    stored = {key: value for key, value in holding(TwoPaths(), "model").state_dict().items() if ".net." in key}
    torch.save(stored, tmp_path / "ambiguous.pt")  # model.net.bn.*: TwoPaths fits without model. and model.net.
    with pytest.raises(CheckpointError) as info:
        load_into_model(TwoPaths(), load_checkpoint(tmp_path / "ambiguous.pt"))
    assert str(info.value) == (
        "checkpoint keys match the architecture without 'model.' and 'model.net.' alike "
        "(tried as stored and without 'model.', 'model.net.' or 'model.net.bn.'); "
        "save the state_dict of the bare model so its keys match as stored"
    )
    # keys that match as stored are taken so, even when a prefix would fit too
    torch.save({key.removeprefix("model."): value for key, value in stored.items()}, tmp_path / "own.pt")
    checkpoint = load_checkpoint(tmp_path / "own.pt")
    load_into_model(TwoPaths(), checkpoint)
    assert checkpoint.prefix == ""


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (["a.b.c", "a.b.d"], ["a.", "a.b."]),
        (["a.b.c", "a.x"], ["a."]),
        (["a.b", "b.b"], []),
        (["a.b", "a"], []),  # a prefix never swallows a whole key
        (["module.w"], ["module."]),
        (["layer0.weight", "layer1.weight"], []),  # components, not characters
    ],
)
def test_shared_prefixes_are_whole_dotted_components(keys: list[str], expected: list[str]) -> None:
    assert shared_prefixes(keys) == expected
