"""Shared helpers of the ONNX export tests: recalibrated-looking BN statistics, and an
onnxruntime run that is independent of the exporter's own verification (graph
optimizations on, a batch size the exporter never verified)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

FP32_TOLERANCE = 1e-4
FP16_TOLERANCE = 2e-2


def set_batchnorm_statistics(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BN non-trivial statistics and affine parameters, as a recalibration
    would; returns the model in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                n = module.num_features
                module.running_mean.copy_(torch.rand(n, generator=generator) * 2 - 1)
                module.running_var.copy_(torch.rand(n, generator=generator) * 1.5 + 0.5)
                if module.affine:
                    module.weight.copy_(torch.rand(n, generator=generator) + 0.5)
                    module.bias.copy_(torch.rand(n, generator=generator) - 0.5)
    return model.eval()


def recalibrate_batchnorm(model: nn.Module, data: torch.Tensor) -> nn.Module:
    """Recompute the BN statistics on ``data`` (cumulative average), then eval mode."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None
    model.train()
    with torch.no_grad():
        model(data)
    return model.eval()


def op_counts(path: Path) -> Counter:
    """Node op types of the main graph of the ONNX file at ``path``."""
    return Counter(node.op_type for node in onnx.load(str(path)).graph.node)


def run_onnx(path: Path, x: torch.Tensor, dtype: type = np.float32) -> list[np.ndarray]:
    """Run the file in onnxruntime with its default (enabled) graph optimizations."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy().astype(dtype)})


def assert_matches_torch(path: Path, model: nn.Module, x: torch.Tensor, tolerance: float = FP32_TOLERANCE,
                         dtype: type = np.float32) -> float:
    """The ONNX file reproduces ``model(x)`` within ``tolerance * max(1, max|y|)``."""
    with torch.no_grad():
        expected = model.eval()(x)
    if isinstance(expected, torch.Tensor):
        expected = [expected]
    elif isinstance(expected, dict):  # torchvision's segmentation models: {"out": ...}
        expected = list(expected.values())
    else:
        expected = list(expected)
    got = run_onnx(path, x, dtype)
    assert len(got) == len(expected)
    worst = 0.0
    for onnx_out, torch_out in zip(got, expected):
        reference = torch_out.double().numpy()
        assert onnx_out.shape == reference.shape
        diff = float(np.max(np.abs(onnx_out.astype(np.float64) - reference)))
        assert diff <= tolerance * max(1.0, float(np.max(np.abs(reference)))), diff
        worst = max(worst, diff)
    return worst
