"""Loading checkpoints safely and writing them back in their own format and layout."""

from __future__ import annotations

import logging
import os
import pickle
import shlex
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file, save_model

from bnrecal.errors import CheckpointError
from bnrecal.workers.models.checkpoints import Checkpoint, load_checkpoint, load_into_model, save_checkpoint

from tests.workers.models.model_zoo import SmallCNN, TiedNet


def trained_like_model(seed: int = 0) -> SmallCNN:
    """A SmallCNN whose weights and BN statistics are all non-default."""
    torch.manual_seed(seed)
    model = SmallCNN(num_classes=3, width=4)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("num_batches_tracked"):
                tensor.fill_(123)
            elif name.endswith("running_var"):
                tensor.copy_(torch.rand_like(tensor) + 0.5)
            else:
                tensor.copy_(torch.randn_like(tensor))
    return model


def optimizer_state(model: torch.nn.Module) -> dict[str, Any]:
    """A real SGD-with-momentum state dict (tensors, ints, floats, nested lists)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    optimizer.step()
    model.zero_grad()
    return optimizer.state_dict()


def bn_updates(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """New float64 statistics for every BN buffer, as the calibrator produces them."""
    generator = torch.Generator().manual_seed(7)
    updates: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            channels = module.num_features
            mean = torch.randn(channels, generator=generator, dtype=torch.float64)
            var = torch.rand(channels, generator=generator, dtype=torch.float64) + 1
            updates[f"{name}.running_mean"] = mean
            updates[f"{name}.running_var"] = var
            updates[f"{name}.num_batches_tracked"] = torch.tensor(130)
    return updates


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so NaN payloads and -0.0 compare exactly."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(new: Any, old: Any, where: str = "") -> None:
    """Recursively: same structure, non-tensor values equal, tensors bit-identical."""
    assert type(new) is type(old), where
    if isinstance(old, torch.Tensor):
        assert new.dtype == old.dtype and new.shape == old.shape, where
        assert torch.equal(bits(new), bits(old)), where
    elif isinstance(old, dict):
        assert list(new) == list(old), where
        for key in old:
            assert_same(new[key], old[key], f"{where}/{key}")
    elif isinstance(old, (list, tuple)):
        assert len(new) == len(old), where
        for index, (a, b) in enumerate(zip(new, old)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert new == old, where


def wrap(layout: str, state: dict[str, torch.Tensor], model: torch.nn.Module) -> Any:
    """Put a state dict into one of the supported layouts."""
    if layout == "plain":
        return state
    return {
        "epoch": 7,
        "arch": "small_cnn",
        layout: state,
        "optimizer": optimizer_state(model),
        "best_acc": 0.93,
    }


LAYOUTS = ["plain", "state_dict", "model", "model_state_dict", "module"]


@pytest.mark.parametrize("ddp", [False, True], ids=["bare", "ddp"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_layouts_load_and_round_trip(tmp_path: Path, layout: str, ddp: bool) -> None:
    source = trained_like_model()
    state = source.state_dict()
    if ddp:
        state = OrderedDict((f"module.{key}", value) for key, value in state.items())
    container = wrap(layout, state, source)
    path = tmp_path / "ckpt.pth"
    torch.save(container, path)

    checkpoint = load_checkpoint(path)
    assert checkpoint.format == "torch"
    assert checkpoint.location == (() if layout == "plain" else (layout,))
    assert checkpoint.prefix == ""  # undecided until the model's keys are known

    model = SmallCNN(num_classes=3, width=4)
    load_into_model(model, checkpoint)
    assert checkpoint.prefix == ("module." if ddp else "")
    assert list(checkpoint.state_dict) == list(source.state_dict())
    assert_same(dict(model.state_dict()), dict(source.state_dict()))

    updates = bn_updates(model)
    out = tmp_path / "out.pth"
    save_checkpoint(checkpoint, updates, out)
    original = torch.load(path, weights_only=True)
    written = torch.load(out, weights_only=True)
    written_state = written if layout == "plain" else written[layout]
    original_state = original if layout == "plain" else original[layout]
    prefix = "module." if ddp else ""
    assert list(written_state) == list(original_state)
    for key, old in original_state.items():
        model_key = key.removeprefix(prefix)
        if model_key in updates:
            assert written_state[key].dtype == old.dtype and written_state[key].shape == old.shape
            assert torch.equal(written_state[key], updates[model_key].to(old.dtype))
        else:
            assert_same(written_state[key], old, key)
    if layout != "plain":
        rest_new = {k: v for k, v in written.items() if k != layout}
        rest_old = {k: v for k, v in original.items() if k != layout}
        assert_same(rest_new, rest_old)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pth", "out.pth"]  # no temp files left


def test_safetensors_with_metadata_and_prefix_round_trip(tmp_path: Path) -> None:
    source = trained_like_model(1)
    state = {f"module.{key}": value.clone() for key, value in source.state_dict().items()}
    metadata = {"format": "pt", "trained_by": "unit-test", "epoch": "12"}
    path = tmp_path / "weights.bin"  # format comes from the content, not the name
    save_file(state, path, metadata=metadata)

    checkpoint = load_checkpoint(path)
    assert checkpoint.format == "safetensors"
    assert checkpoint.metadata == metadata
    model = SmallCNN(num_classes=3, width=4)
    load_into_model(model, checkpoint)
    assert checkpoint.prefix == "module."
    assert_same(dict(model.state_dict()), dict(source.state_dict()))

    updates = bn_updates(model)
    out = tmp_path / "out.safetensors"
    save_checkpoint(checkpoint, updates, out)
    with safe_open(str(out), framework="pt") as handle:
        assert handle.metadata() == metadata
        written = {key: handle.get_tensor(key) for key in handle.keys()}
    assert sorted(written) == sorted(state)
    for key, old in state.items():
        model_key = key.removeprefix("module.")
        if model_key in updates:
            assert torch.equal(written[key], updates[model_key].to(old.dtype))
        else:
            assert_same(written[key], old, key)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_half_precision_checkpoint_loads_into_float32_and_saves_in_its_dtype(
    tmp_path: Path, dtype: torch.dtype, fmt: str
) -> None:
    source = trained_like_model(2)
    state = {
        k: v.to(dtype) if v.is_floating_point() else v.clone()
        for k, v in source.state_dict().items()
    }
    path = tmp_path / "half.ckpt"
    if fmt == "torch":
        torch.save({"model": state}, path)
    else:
        save_file(state, path)
    checkpoint = load_checkpoint(path)
    model = SmallCNN(num_classes=3, width=4)
    load_into_model(model, checkpoint)
    for key, value in model.state_dict().items():
        counter = key.endswith("num_batches_tracked")
        assert value.dtype == (torch.int64 if counter else torch.float32)
        assert torch.equal(value, state[key].to(value.dtype)), key

    updates = bn_updates(model)
    save_checkpoint(checkpoint, updates, path)  # overwrite in place
    reloaded = load_checkpoint(path).state_dict
    for key, old in state.items():
        assert reloaded[key].dtype == old.dtype
        expected = updates[key].to(old.dtype) if key in updates else old
        assert torch.equal(bits(reloaded[key]), bits(expected)), key


def test_legacy_batchnorm_checkpoint_without_counters(tmp_path: Path) -> None:
    source = trained_like_model(3)
    state = source.state_dict()  # an OrderedDict carrying torch's _metadata (BN version 2)
    for key in [k for k in state if k.endswith("num_batches_tracked")]:
        del state[key]
    path = tmp_path / "legacy.pt"
    torch.save(state, path)
    checkpoint = load_checkpoint(path)
    model = SmallCNN(num_classes=3, width=4)
    load_into_model(model, checkpoint)
    assert torch.equal(model.neck_bn.running_var, source.neck_bn.running_var)
    assert int(model.neck_bn.num_batches_tracked) == 0

    out = tmp_path / "out.pt"
    save_checkpoint(checkpoint, bn_updates(model), out)
    written = torch.load(out, weights_only=True)
    assert list(written) == list(state)  # counters skipped, never added
    new_var = bn_updates(model)["neck_bn.running_var"].float()
    assert torch.equal(written["neck_bn.running_var"], new_var)


def test_strict_load_names_missing_unexpected_and_mismatched_keys(tmp_path: Path) -> None:
    state = trained_like_model().state_dict()
    del state["neck.bias"]
    state["extra.weight"] = torch.zeros(2)
    state["head.weight"] = torch.zeros(5, 8)
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    model = SmallCNN(num_classes=3, width=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_into_model(model, load_checkpoint(path))
    message = str(info.value)
    assert "1 missing: neck.bias" in message
    assert "1 unexpected: extra.weight" in message
    assert "head.weight (5, 8) vs model (3, 8)" in message
    assert "\n" not in message
    assert_same(dict(model.state_dict()), before)  # nothing half-loaded


def test_strict_load_lists_a_few_keys_and_counts_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    torch.save({f"layer{i}.weight": torch.zeros(1) for i in range(9)}, path)
    model = SmallCNN(num_classes=3, width=4)
    with pytest.raises(CheckpointError) as info:
        load_into_model(model, load_checkpoint(path))
    message = str(info.value)
    # every key but the BN counters, which legacy checkpoints may lack
    expected_missing = [k for k in model.state_dict() if not k.endswith("num_batches_tracked")]
    assert f"{len(expected_missing)} missing: features.0.weight" in message
    assert "9 unexpected: layer0.weight" in message
    assert "layer8.weight" not in message and "..." in message


def test_tied_weights_stored_once_in_safetensors_load_and_save(tmp_path: Path) -> None:
    torch.manual_seed(4)
    source = TiedNet()
    path = tmp_path / "tied.safetensors"
    save_model(source, str(path))  # keeps one of first.* / second.*
    checkpoint = load_checkpoint(path)
    assert len(checkpoint.state_dict) < len(source.state_dict())
    model = TiedNet()
    load_into_model(model, checkpoint)
    assert torch.equal(model.first.weight, source.first.weight)
    assert model.second.weight is model.first.weight

    # entries sharing memory (here made so on purpose) are written as separate tensors
    stored = checkpoint.container
    stored["bn.running_var"] = stored["bn.running_mean"]
    out = tmp_path / "out.safetensors"
    save_checkpoint(checkpoint, {"bn.running_mean": torch.full((4,), 2.0)}, out)
    written = load_checkpoint(out).state_dict
    assert torch.equal(written["bn.running_mean"], torch.full((4,), 2.0))
    assert torch.equal(written["bn.running_var"], source.bn.running_mean)


def test_update_with_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    torch.save(trained_like_model().state_dict(), path)
    checkpoint = load_checkpoint(path)
    with pytest.raises(CheckpointError, match="neck_bn.running_mean"):
        save_checkpoint(checkpoint, {"neck_bn.running_mean": torch.zeros(3)}, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    assert sorted(os.listdir(tmp_path)) == ["c.pt"]


class _Payload:
    """Unpickling this runs a shell command that creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle2", "pickle4"])
def test_pickle_that_needs_code_execution_is_refused_and_not_run(
    tmp_path: Path, writer: str
) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    if writer == "torch.save":
        torch.save({"state_dict": {"w": torch.zeros(1)}, "hook": _Payload(marker)}, path)
    else:  # a bare pickle, as torch's legacy format starts
        with path.open("wb") as handle:
            pickle.dump({"epoch": 1, "hook": _Payload(marker)}, handle, protocol=int(writer[-1]))
    assert not marker.exists()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert "full unpickle" in str(info.value)
    assert "evil.pt" in str(info.value)
    assert not marker.exists()
    if writer != "pickle4":
        assert "system" in str(info.value)  # names the global it refused


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"this is a text file, not weights\n",
        os.urandom(256),
        (15).to_bytes(8, "little") + b'{"a": {"dtype":',  # safetensors header, broken JSON
    ],
    ids=["empty", "text", "random", "bad-safetensors"],
)
def test_unreadable_files_are_named(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "broken.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="broken.safetensors"):
        load_checkpoint(path)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_truncated_files_are_named(tmp_path: Path, fmt: str) -> None:
    good = tmp_path / "good"
    state = trained_like_model().state_dict()
    if fmt == "torch":
        torch.save(state, good)
    else:
        save_file(dict(state), good)
    data = good.read_bytes()
    path = tmp_path / "cut.ckpt"
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="cut.ckpt"):
        load_checkpoint(path)


@pytest.mark.parametrize("kept", [0.5, 0.98], ids=["half", "tail-cut"])
def test_a_cut_torch_file_is_one_sentence_naming_the_given_name(tmp_path, caplog, kept) -> None:
    torch.save(trained_like_model().state_dict(), tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    stored = tmp_path / ("ab" * 32)  # a blob is stored under its digest; the user knows its name
    stored.write_bytes(data[: int(len(data) * kept)])
    with caplog.at_level(logging.INFO, "bnrecal.checkpoints"), pytest.raises(CheckpointError) as info:
        load_checkpoint(stored, name="model.pt")
    assert str(info.value) == "checkpoint 'model.pt' is truncated or not a torch/safetensors file"
    assert info.value.__cause__ is not None  # torch's own words stay in the chain and the log
    assert "'model.pt'" in caplog.text and "torch.load failed" in caplog.text


def test_files_without_a_state_dict_are_refused(tmp_path: Path) -> None:
    tensor_only = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), tensor_only)
    with pytest.raises(CheckpointError, match="not a state dict"):
        load_checkpoint(tensor_only)
    no_weights = tmp_path / "nested.pt"
    torch.save({"epoch": 3, "weights": {"w": torch.zeros(1)}}, no_weights)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(no_weights)
    assert "model_state_dict" in str(info.value) and "'weights'" in str(info.value)
    with pytest.raises(CheckpointError, match="missing.pt"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="directory"):
        load_checkpoint(tmp_path)


def test_first_matching_key_wins_and_must_hold_tensors(tmp_path: Path) -> None:
    state = trained_like_model().state_dict()
    path = tmp_path / "both.pt"
    # "state_dict" comes first in the search but holds no tensors; "model" does
    torch.save({"state_dict": {"lr": 0.1}, "model": state, "module": {"x": torch.zeros(1)}}, path)
    checkpoint = load_checkpoint(path)
    assert checkpoint.location == ("model",)
    assert isinstance(checkpoint, Checkpoint)


def test_saved_checkpoint_gets_the_usual_file_mode(tmp_path):
    import os
    import stat

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    torch.save(model.state_dict(), tmp_path / "in.pt")
    save_checkpoint(load_checkpoint(tmp_path / "in.pt"), {}, tmp_path / "out.pt")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE((tmp_path / "out.pt").stat().st_mode) == 0o666 & ~mask


def test_same_content_saves_to_the_same_bytes(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    torch.save({"model": model.state_dict()}, tmp_path / "in.pt")
    checkpoint = load_checkpoint(tmp_path / "in.pt")
    save_checkpoint(checkpoint, {"1.running_var": torch.full((2,), 3.0)}, tmp_path / "a.pt")
    save_checkpoint(checkpoint, {"1.running_var": torch.full((2,), 3.0)}, tmp_path / "other-name.pt")
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "other-name.pt").read_bytes()
