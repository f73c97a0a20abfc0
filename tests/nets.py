"""Small models for the tests, importable by Ray workers as ``tests.nets:<factory>``."""

from __future__ import annotations

import torch
from torch import nn


class MixedNet(nn.Module):
    """Conv2d -> BN2d, depthwise conv -> BN2d, an affine=False BN, a Dropout that must stay off,
    then BN1d on (N, C, L) and BN1d on (N, C)."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.depthwise = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.bn_dw = nn.BatchNorm2d(channels)
        self.bn_plain = nn.BatchNorm2d(channels, affine=False)
        self.drop = nn.Dropout(p=0.5)
        self.seq_conv = nn.Conv1d(channels, 5, 3)
        self.bn_seq = nn.BatchNorm1d(5)
        self.fc = nn.Linear(5, 4)
        self.bn_fc = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.relu(self.bn_dw(self.depthwise(x)))
        x = self.drop(self.bn_plain(x))
        x = x.flatten(2)  # (N, C, H*W)
        x = torch.relu(self.bn_seq(self.seq_conv(x)))
        return self.bn_fc(self.fc(x.mean(2)))


class VolumeNet(nn.Module):
    """Conv3d -> BN3d -> pooled linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm3d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3, 4)))


class FarFromZeroNet(nn.Module):
    """The raw input goes straight into a BN layer: data with mean 1e3 and std 1e-2 tests
    that the variance survives the cancellation float32 sums would suffer."""

    def __init__(self, features: int = 3) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(features)
        self.fc = nn.Linear(features, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x))


class NoNormNet(nn.Module):
    """No BN layer at all."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def mixed_net(channels: int = 6) -> nn.Module:
    """Factory for ``tests.nets:mixed_net``."""
    return MixedNet(channels)


def volume_net() -> nn.Module:
    """Factory for ``tests.nets:volume_net``."""
    return VolumeNet()


def far_from_zero_net(features: int = 3) -> nn.Module:
    """Factory for ``tests.nets:far_from_zero_net``."""
    return FarFromZeroNet(features)


def no_norm_net() -> nn.Module:
    """Factory for ``tests.nets:no_norm_net``."""
    return NoNormNet()


def perturbed(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give a model non-trivial weights and stale BN statistics, as a trained model would have."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            if name.endswith("running_var"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
            elif name.endswith("running_mean"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3)
            elif name.endswith("weight") and tensor.dim() == 1:
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
            else:
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.05)
    return model


MARKER = 4242.0
"""A sample whose first value is MARKER makes ``marker_net`` misbehave on that rank."""


class MarkerNet(nn.Module):
    """BN1d on (N, 4) that dies (``exit``), dies the first time only (``exit_once``, which
    needs ``signal_dir``) or hangs (``hang``) on a marked sample: a rank failing mid-job."""

    def __init__(self, action: str = "exit", signal_dir: str | None = None) -> None:
        super().__init__()
        self.action = action
        self.signal_dir = signal_dir
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() and bool((x[:, 0] == MARKER).any()):
            if self.action == "exit_once" and self.signal_dir:
                from pathlib import Path

                first = Path(self.signal_dir, "failed-once")
                if first.exists():
                    return self.fc(self.bn(x))
                first.touch()
            if self.action in ("exit", "exit_once"):
                import os

                os._exit(3)
            import os
            import time
            from pathlib import Path

            if self.signal_dir:
                Path(self.signal_dir, f"hanging-{os.getpid()}").touch()
            time.sleep(3600)
        return self.fc(self.bn(x))


def marker_net(action: str = "exit", signal_dir: str | None = None) -> nn.Module:
    """Factory for ``tests.nets:marker_net``; with ``signal_dir``, a hanging rank leaves a file there."""
    return MarkerNet(action, signal_dir)
