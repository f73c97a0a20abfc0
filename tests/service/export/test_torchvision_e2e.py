"""torchvision classifiers end to end: recalibrated BN statistics, folded export, every
BN that follows a conv folded, the pre-activation BNs of DenseNet left with a reason, and
an independent onnxruntime match (graph optimizations on, an unverified batch size)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from service.export import export_folded_onnx
from tests.service.export.helpers import assert_matches_torch, op_counts, recalibrate_batchnorm

SHAPE = (3, 64, 64)


def _recalibrated(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None)
    return recalibrate_batchnorm(model, torch.randn(16, *SHAPE) * 1.5 + 0.2)


def _batchnorms(model: nn.Module) -> int:
    return sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "efficientnet_b0"])
def test_every_batchnorm_folds(name: str, tmp_path: Path) -> None:
    model = _recalibrated(name)
    out = tmp_path / f"{name}.onnx"
    report = export_folded_onnx(model, torch.randn(8, *SHAPE), out)
    assert (report["folded"], report["batchnorm_nodes"], report["unfolded"]) == (_batchnorms(model), 0, [])
    assert op_counts(out)["BatchNormalization"] == 0
    assert report["verified_batches"] == [1, 8]
    assert_matches_torch(out, model, torch.randn(3, *SHAPE))


@pytest.mark.slow
def test_densenet121_keeps_its_preactivation_batchnorms(tmp_path: Path) -> None:
    """DenseNet normalises concatenations (BN -> ReLU -> Conv): those BNs cannot fold;
    the BN after each bottleneck conv (norm2) and after conv0 can."""
    model = _recalibrated("densenet121")
    out = tmp_path / "densenet121.onnx"
    report = export_folded_onnx(model, torch.randn(8, *SHAPE), out)
    dense_layers = sum((6, 12, 24, 16))
    left = dense_layers + 3 + 1  # every norm1, three transitions, norm5
    assert (report["folded"], report["batchnorm_nodes"]) == (dense_layers + 1, left)
    assert _batchnorms(model) == report["folded"] + left
    assert op_counts(out)["BatchNormalization"] == left
    pattern = re.compile(r"features\.(denseblock\d\.denselayer\d+\.norm1|transition\d\.norm|norm5)")
    assert all(pattern.fullmatch(u["name"]) for u in report["unfolded"])
    assert all("is not Conv" in u["reason"] for u in report["unfolded"])
    assert_matches_torch(out, model, torch.randn(3, *SHAPE))
