"""The float64 fold formulas against PyTorch's own conv/linear + batch_norm, in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bnrecal.service.export.folding.arithmetic import batchnorm_affine, fold_into_conv_input, fold_into_producer


def _bn_params(channels: int, seed: int = 0, affine: bool = True):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(channels, generator=g, dtype=torch.float64)
    var = torch.rand(channels, generator=g, dtype=torch.float64) + 0.1
    gamma = torch.rand(channels, generator=g, dtype=torch.float64) + 0.5 if affine else None
    beta = torch.randn(channels, generator=g, dtype=torch.float64) if affine else None
    return gamma, beta, mean, var


def _np(t: torch.Tensor | None):
    return None if t is None else t.numpy()


def _bn(y: torch.Tensor, params, eps: float) -> torch.Tensor:
    gamma, beta, mean, var = params
    return F.batch_norm(y, mean, var, gamma, beta, training=False, eps=eps)


@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_affine_is_the_eval_batchnorm(affine: bool) -> None:
    params = _bn_params(5, affine=affine)
    x = torch.randn(7, 5, dtype=torch.float64)
    scale, shift = batchnorm_affine(*map(_np, params), eps=1e-3)
    np.testing.assert_allclose(scale * x.numpy() + shift, _bn(x, params, 1e-3).numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dims,groups,bias", [(1, 1, True), (2, 1, False), (2, 2, True), (2, 6, False), (3, 3, True)])
def test_fold_into_conv_output(dims: int, groups: int, bias: bool) -> None:
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    weight = torch.randn(6, 6 // groups, *([3] * dims), dtype=torch.float64)
    b = torch.randn(6, dtype=torch.float64) if bias else None
    x = torch.randn(2, 6, *([5] * dims), dtype=torch.float64)
    params = _bn_params(6)
    scale, shift = batchnorm_affine(*map(_np, params), eps=1e-5)
    w2, b2 = fold_into_producer(weight.numpy(), _np(b), scale, shift, "conv", groups)
    expected = _bn(conv(x, weight, b, groups=groups, padding=1), params, 1e-5)
    got = conv(x, torch.from_numpy(w2), torch.from_numpy(b2), groups=groups, padding=1)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("groups,out_per_group", [(1, 4), (2, 2), (3, 2)])
def test_fold_into_conv_transpose_output(groups: int, out_per_group: int) -> None:
    weight = torch.randn(6, out_per_group, 3, 3, dtype=torch.float64)  # (C_in, C_out/g, k, k)
    out_channels = out_per_group * groups
    x = torch.randn(2, 6, 4, 4, dtype=torch.float64)
    params = _bn_params(out_channels, seed=1)
    scale, shift = batchnorm_affine(*map(_np, params), eps=1e-5)
    w2, b2 = fold_into_producer(weight.numpy(), None, scale, shift, "conv_transpose", groups)
    expected = _bn(F.conv_transpose2d(x, weight, groups=groups, stride=2), params, 1e-5)
    got = F.conv_transpose2d(x, torch.from_numpy(w2), torch.from_numpy(b2), groups=groups, stride=2)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_fold_into_linear_output(layout: str) -> None:
    weight = torch.randn(4, 3, dtype=torch.float64)  # (out, in)
    bias = torch.randn(4, dtype=torch.float64)
    x = torch.randn(5, 3, dtype=torch.float64)
    params = _bn_params(4, seed=2)
    scale, shift = batchnorm_affine(*map(_np, params), eps=1e-5)
    stored = weight.numpy() if layout == "out_in" else weight.numpy().T
    w2, b2 = fold_into_producer(stored, bias.numpy(), scale, shift, layout)
    w2 = w2 if layout == "out_in" else w2.T
    expected = _bn(F.linear(x, weight, bias), params, 1e-5)
    torch.testing.assert_close(F.linear(x, torch.from_numpy(w2), torch.from_numpy(b2)), expected)


@pytest.mark.parametrize("groups,bias", [(1, True), (2, False), (4, True)])
def test_fold_into_conv_input_without_padding(groups: int, bias: bool) -> None:
    weight = torch.randn(8, 4 // groups, 3, 3, dtype=torch.float64)
    b = torch.randn(8, dtype=torch.float64) if bias else None
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    params = _bn_params(4, seed=3)
    scale, shift = batchnorm_affine(*map(_np, params), eps=1e-5)
    w2, b2 = fold_into_conv_input(weight.numpy(), _np(b), scale, shift, groups)
    expected = F.conv2d(_bn(x, params, 1e-5), weight, b, groups=groups)
    got = F.conv2d(x, torch.from_numpy(w2), torch.from_numpy(b2), groups=groups)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_fold_with_zero_padding_would_be_wrong() -> None:
    """Why BN -> Conv needs padding 0: with zero padding the borders differ."""
    weight = torch.randn(2, 2, 3, 3, dtype=torch.float64)
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    params = _bn_params(2, seed=4)
    scale, shift = batchnorm_affine(*map(_np, params), eps=1e-5)
    w2, b2 = fold_into_conv_input(weight.numpy(), None, scale, shift)
    expected = F.conv2d(_bn(x, params, 1e-5), weight, padding=1)
    got = F.conv2d(x, torch.from_numpy(w2), torch.from_numpy(b2), padding=1)
    torch.testing.assert_close(got[..., 1:-1, 1:-1], expected[..., 1:-1, 1:-1])
    assert not torch.allclose(got, expected)


def test_channel_mismatch_is_refused() -> None:
    scale, shift = np.ones(3), np.zeros(3)
    with pytest.raises(ValueError, match="channels"):
        fold_into_producer(np.ones((4, 2, 3, 3)), None, scale, shift, "conv")
    with pytest.raises(ValueError, match="channels"):
        fold_into_conv_input(np.ones((4, 2, 3, 3)), None, scale, shift)
