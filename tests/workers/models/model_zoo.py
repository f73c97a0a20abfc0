"""Small model factories for tests, importable as ``tests.workers.models.model_zoo:<name>``."""

from __future__ import annotations

import torch
from torch import nn

NOT_CALLABLE = 42


class SmallCNN(nn.Module):
    """Conv-BN-ReLU twice, a BN1d head: every BN flavour the workers meet, in a few kB."""

    def __init__(self, num_classes: int = 10, width: int = 8, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.neck = nn.Linear(2 * width, 2 * width)
        self.neck_bn = nn.BatchNorm1d(2 * width)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a batch of images."""
        return self.head(torch.relu(self.neck_bn(self.neck(self.features(x)))))


def small_cnn(num_classes: int = 10, width: int = 8, in_channels: int = 1) -> SmallCNN:
    """A fresh :class:`SmallCNN`."""
    return SmallCNN(num_classes=num_classes, width=width, in_channels=in_channels)


class TiedNet(nn.Module):
    """A conv applied twice through two names: the same weight under two state-dict keys."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(4, 4, 1)
        self.second = self.first
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Two passes through the shared conv, then BN."""
        return self.bn(self.second(torch.relu(self.first(x))))


def tied_net() -> TiedNet:
    """A fresh :class:`TiedNet`."""
    return TiedNet()


def not_a_module() -> dict[str, int]:
    """A factory that forgets to return a model."""
    return {"layers": 3}


def double_precision_cnn() -> SmallCNN:
    """A SmallCNN in float64, to check that models are handed out in float32."""
    return SmallCNN().double()
