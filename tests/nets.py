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
    needs ``signal_dir``) or hangs (``hang``, for ``hang_s`` seconds) on a marked sample: a
    rank failing, or being slow, mid-job."""

    def __init__(self, action: str = "exit", signal_dir: str | None = None, hang_s: float = 3600.0) -> None:
        super().__init__()
        self.action = action
        self.signal_dir = signal_dir
        self.hang_s = hang_s
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
            time.sleep(self.hang_s)
        return self.fc(self.bn(x))


def marker_net(action: str = "exit", signal_dir: str | None = None, hang_s: float = 3600.0) -> nn.Module:
    """Factory for ``tests.nets:marker_net``; with ``signal_dir``, a hanging rank leaves a file there."""
    return MarkerNet(action, signal_dir, hang_s)


class ActBatchNorm2d(nn.BatchNorm2d):
    """A user's BN subclass: its own arithmetic after normalising, as timm's BatchNormAct2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x)) * 1.5 + 0.1


class SelfStatsBatchNorm2d(nn.BatchNorm2d):
    """Computes its own batch statistics in training (as detectron2's NaiveSyncBatchNorm
    does before all-reducing them): it never reaches F.batch_norm there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        mean = x.mean((0, 2, 3), keepdim=True)
        var = x.var((0, 2, 3), unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


class SubclassNet(nn.Module):
    """A BN subclass with its own forward, a BN module called twice, and (optionally)
    timm's BatchNormAct2d with an activation and a drop layer."""

    def __init__(self, channels: int = 6, bn_class: type[nn.BatchNorm2d] = ActBatchNorm2d, timm_act: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = bn_class(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.shared = nn.BatchNorm2d(channels)
        if timm_act:
            from timm.layers import BatchNormAct2d

            self.bn_act: nn.Module = BatchNormAct2d(channels, act_layer=nn.SiLU, drop_layer=nn.Dropout)
        else:
            self.bn_act = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.conv(x))
        x = torch.relu(self.shared(self.conv2(x)))
        x = self.shared(x * 0.5 - 1.0)  # the same module again, on different values
        x = self.bn_act(x)
        return self.fc(x.mean((2, 3)))


def subclass_net(timm_act: bool = False) -> nn.Module:
    """Factory for ``tests.nets:subclass_net``."""
    return SubclassNet(timm_act=timm_act)


def self_stats_net() -> nn.Module:
    """Factory for ``tests.nets:self_stats_net``: a layer bnrecal must refuse."""
    return SubclassNet(bn_class=SelfStatsBatchNorm2d)


def sync_bn_net() -> nn.Module:
    """Factory for ``tests.nets:sync_bn_net``: every BN layer of a SubclassNet converted to SyncBatchNorm."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(SubclassNet(bn_class=nn.BatchNorm2d))


class BranchingNet(nn.Module):
    """Calls its two BN layers in an order that depends on the data: a batch whose mean is
    positive goes through ``a`` then ``b``, any other through ``b`` then ``a``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.BatchNorm1d(4)
        self.b = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.mean() > 0):
            return self.b(self.a(x))
        return self.a(self.b(x))


def branching_net() -> nn.Module:
    """Factory for ``tests.nets:branching_net``."""
    return BranchingNet()


class ClassifierNet(nn.Module):
    """Conv -> BN -> ReLU -> pool -> Linear: (N, classes) logits, for evaluation."""

    def __init__(self, classes: int = 12) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class SegmenterNet(nn.Module):
    """Per-pixel class scores in a dict, as torchvision's segmentation models return them."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, classes, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.head(torch.relu(self.bn(self.conv(x))))}


class FeatureListNet(nn.Module):
    """Returns a list of feature maps' shapes, no tensor of logits: nothing to evaluate."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> dict[str, list[int]]:
        return {"shape": list(self.bn(self.conv(x)).shape)}


def classifier_net(classes: int = 12) -> nn.Module:
    """Factory for ``tests.nets:classifier_net``."""
    return ClassifierNet(classes)


def segmenter_net(classes: int = 5) -> nn.Module:
    """Factory for ``tests.nets:segmenter_net``."""
    return SegmenterNet(classes)


def feature_list_net() -> nn.Module:
    """Factory for ``tests.nets:feature_list_net``."""
    return FeatureListNet()


def slow_start_net(seconds: float = 3600.0) -> nn.Module:
    """Factory for ``tests.nets:slow_start_net``: ``mixed_net`` that takes ``seconds`` to
    build inside a calibration rank (a rank still starting up), at once on the driver
    (the CLI's process, or the server's job host actor)."""
    import ray

    if ray.is_initialized() and _current_actor_class() == "CalibrationRank":
        import time

        time.sleep(seconds)
    return MixedNet()


def _current_actor_class() -> str | None:
    """The class name of the Ray actor this code runs in (None outside an actor)."""
    import ray

    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return None
    return context.current_actor._ray_actor_creation_function_descriptor.class_name


class UntrackedNet(nn.Module):
    """A BN with momentum None, one that keeps no running statistics (it normalises with
    batch statistics even in eval mode, as some GAN discriminators do), then a BN with
    momentum 0.01: the last one sees values that depend on how the middle one normalises."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn_cumulative = nn.BatchNorm2d(6, momentum=None)
        self.bn_untracked = nn.BatchNorm2d(6, track_running_stats=False)
        self.conv2 = nn.Conv2d(6, 5, 3)
        self.bn_slow = nn.BatchNorm2d(5, momentum=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn_untracked(self.bn_cumulative(self.conv(x))))
        return self.bn_slow(self.conv2(x)).mean((2, 3))


def untracked_net() -> nn.Module:
    """Factory for ``tests.nets:untracked_net``."""
    return UntrackedNet()
