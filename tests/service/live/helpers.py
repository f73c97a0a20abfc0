"""What the Python API tests check on every recalibrated model."""

from __future__ import annotations

import torch
from torch import nn

BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def assert_only_bn_buffers_changed(before: dict[str, torch.Tensor], model: nn.Module, steps: int) -> None:
    """Every tensor but the BN running buffers is unchanged bit for bit; num_batches_tracked grew by ``steps``."""
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key].dtype == value.dtype and after[key].shape == value.shape, key
        if key.endswith("num_batches_tracked"):
            assert int(after[key]) == int(value) + steps, key
        elif not key.endswith(BN_BUFFERS):
            assert torch.equal(after[key], value), f"{key} changed"


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A deep copy of the model's state dict."""
    return {key: value.detach().clone() for key, value in model.state_dict().items()}
