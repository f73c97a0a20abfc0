"""The memory layout a rank computes in.

Convolution and BatchNorm kernels are faster in channels-last layout than in the default
one for the image models users bring. Measured on this project's CPU (2 threads, batch
16, 224x224, eval forward, each layout timed after a warm-up), channels-last took 0.55x
to 0.94x the default layout's time on every one of the 20 torchvision and timm models of
the test zoo: 0.79x resnet18, 0.84x efficientnet_b0, 0.55x googlenet, 0.94x LeViT.

So ``auto`` does not measure on the fly (an earlier version timed one step in each
layout: that cost a slow step per job, and on a noisy machine it sometimes kept the
slower layout): image batches (4-D, or 5-D for volumes) run channels-last, everything
else in the default layout. ``contiguous`` and ``channels_last`` fix the layout. The
statistics do not depend on it (the float64 moments are exact to float32 rounding in
either).
"""

from __future__ import annotations

import torch
from torch import nn

MEMORY_FORMATS = ("auto", "contiguous", "channels_last")

_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def rank_layout(setting: str, sample_dims: int) -> str:
    """The layout (``contiguous`` or ``channels_last``) a rank computes batches of
    ``sample_dims`` dimensions in, under the ``memory_format`` setting."""
    if setting not in MEMORY_FORMATS:
        raise ValueError(f"memory format must be one of {MEMORY_FORMATS}, not {setting!r}")
    if setting == "contiguous" or sample_dims not in _CHANNELS_LAST:
        return "contiguous"
    return "channels_last"


def torch_format(layout: str, sample_dims: int) -> torch.memory_format:
    """torch's memory format for ``layout`` at this many batch dimensions."""
    if layout == "channels_last" and sample_dims in _CHANNELS_LAST:
        return _CHANNELS_LAST[sample_dims]
    return torch.contiguous_format


def to_layout(model: nn.Module, layout: str, sample_dims: int) -> None:
    """Put ``model``'s parameters and buffers (in place) in ``layout``; ``contiguous``
    gives a model back as it was built."""
    model.to(memory_format=torch_format(layout, sample_dims))
