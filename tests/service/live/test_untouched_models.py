"""Only BN statistics change on the caller's model (docs/python.md, "What differs, and
why"), for models users bring: mixed train/eval submodules, a YOLO-like detect head that
caches its anchors, a pruned resnet (``torch.nn.utils.prune``: forward pre-hooks that
assign the weight) with a forward hook of the caller's, a float64 model fed by ``forward=``,
torchvision's detection and segmentation models, a Hugging Face model. After the call every
parameter, non-BN buffer, tensor attribute, ``training`` flag, ``requires_grad`` and hook
is as before, the model deep-copies, saves and runs, and its statistics are the
independent reference's. In the calling process (one worker) for all; on two Ray ranks
for the ones whose path differs there (a program export, a pickled module)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import bnrecal
from tests.service.live.guest import assert_statistics, assert_untouched, hooked_reference, snapshot

pytestmark = pytest.mark.usefixtures("ray_cluster")


class Detect(nn.Module):
    """A YOLO-like detect head (ultralytics' ``Detect``): anchors and strides made from the
    feature map's shape on first use and cached in attributes shadowing class attributes."""

    shape = None
    anchors = torch.empty(0)
    strides = torch.empty(0)

    def __init__(self, channels: int = 8, outputs: int = 6) -> None:
        super().__init__()
        self.cv = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.SiLU(),
                                nn.Conv2d(channels, outputs, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv(x)
        if self.shape != x.shape:
            h, w = x.shape[-2:]
            grid = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1)
            self.anchors, self.strides, self.shape = grid.reshape(-1, 2).to(x.dtype) + 0.5, torch.full((h * w, 1), 8.0), x.shape
        boxes = y.flatten(2).transpose(1, 2)
        return torch.cat([(boxes[..., :2] + self.anchors) * self.strides, boxes[..., 2:]], -1)


class TinyYolo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.SiLU())
        self.detect = Detect()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.detect(self.backbone(x))


def mixed_modes() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.Dropout(0.4), nn.Conv2d(6, 4, 1), nn.BatchNorm2d(4))
    model.train()
    model[1].eval()  # a frozen BN: still recalibrated, its mode kept
    model[2].eval()
    model[3].weight.requires_grad_(False)
    return model


def pruned_resnet() -> nn.Module:
    import torchvision
    from torch.nn.utils import prune

    model = torchvision.models.resnet18(weights=None, num_classes=4).eval()
    for module in (model.conv1, model.layer1[0].conv1, model.layer2[0].conv2):
        prune.l1_unstructured(module, "weight", amount=0.5)
    features: list[torch.Tensor] = []
    model.layer4.register_forward_hook(lambda module, args, output: features.append(output.shape))
    return model


def float64_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)).double()


def segmentation() -> nn.Module:
    import torchvision

    return torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3
    ).eval()


def detection() -> nn.Module:
    import torchvision

    return torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64,
    ).eval()


def hugging_face() -> nn.Module:
    pytest.importorskip("transformers")
    from tests.hf import tiny_model

    return tiny_model("RegNetForImageClassification")


def images(count: int, size: int) -> torch.Tensor:
    return torch.randn(count, 3, size, size) * 1.2 + 0.3


def plain(model: nn.Module, batch: Any) -> Any:
    return model(batch)


def first(model: nn.Module, batch: Any) -> Any:
    return model(batch[0])


# name: (model factory, batches, how the reference feeds a batch, recalibrate's options, Ray too)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], list[Any]], Callable[..., Any], dict[str, Any], bool]] = {
    "mixed train/eval submodules": (mixed_modes, lambda: [images(8, 8), images(6, 8)], plain, {}, True),
    "YOLO-like caching detect head": (TinyYolo, lambda: [images(6, 16), images(6, 16)], plain, {}, True),
    "pruned resnet with a hook": (pruned_resnet, lambda: [images(6, 32), images(4, 32)], plain, {}, True),
    "float64 with forward=": (
        float64_net, lambda: [(images(6, 8).double(),), (images(5, 8).double(),)], first,
        {"forward": lambda model, batch: model(batch[0])}, True,
    ),
    "torchvision segmentation": (segmentation, lambda: [images(4, 32), images(4, 32)], plain, {}, False),
    "torchvision detection": (
        detection, lambda: [([img for img in images(4, 48)], [{}] * 4) for _ in range(2)], first, {}, True,
    ),
    "Hugging Face RegNet": (hugging_face, lambda: [images(4, 32), images(4, 32)], plain, {}, False),
}


def recalibrated(case: str, **ranks: Any) -> dict[str, Any]:
    """Recalibrate the case's model, checked against the independent reference (run on the
    same model made again: a pruned model does not deep-copy) and its snapshot; the report."""
    make, data, feed, options, _ = CASES[case]
    batches = data()
    torch.manual_seed(0)
    expected = hooked_reference(make(), batches, feed, copy=False)
    torch.manual_seed(0)
    model = make()
    before = snapshot(model)
    report = bnrecal.recalibrate(model, batches, progress=False, **ranks, **options)
    assert report["steps"] == len(batches)
    assert_statistics(model, expected)
    assert_untouched(before, model, lambda m: feed(m, batches[0]))
    return report


@pytest.mark.parametrize("case", list(CASES))
def test_only_bn_statistics_change_in_process(case):
    assert recalibrated(case)["backend"] == "in-process"


@pytest.mark.parametrize("case", [name for name, spec in CASES.items() if spec[-1]])
def test_only_bn_statistics_change_on_ray_ranks(case, warm_live):
    report = recalibrated(case, workers=2)
    assert report["backend"] == "gloo" and report["world_size"] == 2
