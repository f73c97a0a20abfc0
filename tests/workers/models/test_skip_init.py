"""Building a model for a checkpoint without its random initialization
(``workers.models.skip_init``): where the load writes every tensor, the model is exactly a
real build with the same load, and no random number was drawn; where it would not (a buffer
outside the state dict, a tensor attribute, a tied weight, a constructor that needs real
values), the model is built for real."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from bnrecal.workers.models.architectures import build_model
from bnrecal.workers.models.skip_init import build_for_weights

TORCHVISION = ["torchvision:resnet18", "torchvision:mobilenet_v3_small", "torchvision:efficientnet_b0",
               "torchvision:vit_b_16", "torchvision:convnext_tiny"]
TIMM = ["timm:resnet18", "timm:convnext_atto", "timm:efficientnet_b0"]


def same_as_a_real_build(arch: str, kwargs: dict, allowed: tuple[str, ...] = (), shape=(2, 3, 64, 64)) -> nn.Module:
    """Assert that ``build_for_weights`` + the load is a real build + the load, to the bit."""
    torch.manual_seed(0)
    state = build_model(arch, kwargs, allowed_modules=allowed).state_dict()
    real = build_model(arch, kwargs, allowed_modules=allowed)
    real.load_state_dict(state)
    model = build_for_weights(arch, kwargs, allowed_modules=allowed)
    model.load_state_dict(state)
    mine, theirs = model.state_dict(), real.state_dict()
    assert list(mine) == list(theirs)
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype and torch.equal(mine[key], value), key
    x = torch.randn(*shape)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), real.eval()(x))
    return model


def draws_no_random_number(arch: str, kwargs: dict, allowed: tuple[str, ...] = ()) -> bool:
    """Whether building ``arch`` left torch's random generator where it was."""
    torch.manual_seed(7)
    build_for_weights(arch, kwargs, allowed_modules=allowed)
    after = torch.rand(1)
    torch.manual_seed(7)
    return torch.equal(after, torch.rand(1))


@pytest.mark.parametrize("arch", TORCHVISION)
def test_torchvision_models_skip_their_initialization_and_load_to_the_same_model(arch):
    same_as_a_real_build(arch, {"num_classes": 10}, shape=(2, 3, 224, 224) if "vit" in arch else (2, 3, 64, 64))
    assert draws_no_random_number(arch, {"num_classes": 10})


@pytest.mark.parametrize("arch", TIMM)
def test_timm_models_load_to_the_same_model(arch):
    pytest.importorskip("timm")
    same_as_a_real_build(arch, {"num_classes": 10})


def test_a_legacy_checkpoint_without_num_batches_tracked_gets_the_constructors_zero(tmp_path, settings):
    from bnrecal.service.run.model_source import load_model
    from tests.nets import mixed_net, perturbed

    state = perturbed(mixed_net(), 0).state_dict()
    legacy = {key: value for key, value in state.items() if not key.endswith("num_batches_tracked")}
    torch.save(legacy, tmp_path / "legacy.pt")
    loaded = load_model(settings, arch="tests.nets:mixed_net", checkpoint=tmp_path / "legacy.pt")
    for key, value in loaded.model.state_dict().items():
        expected = torch.tensor(0) if key.endswith("num_batches_tracked") else state[key]
        assert torch.equal(value, expected), key


class KeepsAMask(nn.Module):
    """A buffer outside the state dict: only its constructor knows its value."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("mask", torch.arange(4.0).view(1, 4, 1, 1), persistent=False)

    def forward(self, x):
        return self.bn(self.conv(x)) * self.mask


class KeepsATensor(nn.Module):
    """A plain tensor attribute (not a buffer): the load never writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.scale = [torch.full((1, 4, 1, 1), 3.0)]

    def forward(self, x):
        return self.bn(self.conv(x)) * self.scale[0]


class TiesItsWeights(nn.Module):
    """One parameter in two modules: ``to_empty`` would untie it."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.second = nn.Linear(4, 4)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(self.bn(self.first(x)))


class ReadsAValue(nn.Module):
    """A constructor that reads a tensor's value, as timm's stochastic-depth schedules do."""

    def __init__(self) -> None:
        super().__init__()
        self.width = int(torch.linspace(2, 4, 3)[-1].item())
        self.conv = nn.Conv2d(3, self.width, 3)
        self.bn = nn.BatchNorm2d(self.width)

    def forward(self, x):
        return self.bn(self.conv(x))


@pytest.fixture
def factories(monkeypatch):
    module = types.ModuleType("skip_init_nets")
    for cls in (KeepsAMask, KeepsATensor, TiesItsWeights, ReadsAValue):
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, "skip_init_nets", module)
    return ("skip_init_nets",)


@pytest.mark.parametrize(("name", "shape"), [("KeepsAMask", (2, 3, 8, 8)), ("KeepsATensor", (2, 3, 8, 8)),
                                             ("TiesItsWeights", (2, 4)), ("ReadsAValue", (2, 3, 8, 8))])
def test_a_model_the_load_would_not_fill_is_built_for_real(factories, name, shape):
    model = same_as_a_real_build(f"skip_init_nets:{name}", {}, factories, shape=shape)
    assert not draws_no_random_number(f"skip_init_nets:{name}", {}, factories)  # its constructor ran for real
    if name == "TiesItsWeights":
        assert model.first.weight is model.second.weight
