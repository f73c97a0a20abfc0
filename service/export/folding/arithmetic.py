"""Float64 arithmetic of BatchNorm folding, shared by the PyTorch and the ONNX pass.

In eval mode a BatchNorm layer is a per-channel affine map ``y = scale * x + shift``.
Folding moves that map into the weights of the neighbouring linear layer: into its
output channels when the BN follows the layer, into its input channels when the BN
precedes a convolution without zero padding. Every function here computes in float64
and returns float64 arrays; the callers cast to the graph's dtype once, at the end.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

WeightLayout = Literal["conv", "conv_transpose", "out_in", "in_out"]
"""How a producer stores its weight: ``conv`` (C_out, C_in/g, *k), ``conv_transpose``
(C_in, C_out/g, *k), ``out_in`` (features_out, features_in, e.g. ``nn.Linear`` and
Gemm with transB=1), ``in_out`` (features_in, features_out, e.g. MatMul, Gemm transB=0)."""


def batchnorm_affine(
    gamma: np.ndarray | None,
    beta: np.ndarray | None,
    mean: np.ndarray,
    var: np.ndarray,
    eps: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(scale, shift)`` with ``BN(x) = scale * x + shift`` per channel, in float64.

    ``gamma``/``beta`` are None for a BatchNorm without affine parameters.
    """
    mean64 = np.asarray(mean, dtype=np.float64).reshape(-1)
    var64 = np.asarray(var, dtype=np.float64).reshape(-1)
    gamma64 = np.ones_like(mean64) if gamma is None else np.asarray(gamma, np.float64).reshape(-1)
    beta64 = np.zeros_like(mean64) if beta is None else np.asarray(beta, np.float64).reshape(-1)
    if not (gamma64.shape == beta64.shape == mean64.shape == var64.shape):
        raise ValueError(
            f"BatchNorm parameters disagree in length: gamma {gamma64.shape}, beta {beta64.shape}, "
            f"mean {mean64.shape}, var {var64.shape}"
        )
    scale = gamma64 / np.sqrt(var64 + float(eps))
    shift = beta64 - mean64 * scale
    return scale, shift


def output_channels(weight_shape: tuple[int, ...], layout: WeightLayout, groups: int = 1) -> int:
    """Number of output channels (features) of a producer with this weight."""
    if layout == "conv":
        return weight_shape[0]
    if layout == "conv_transpose":
        return weight_shape[1] * groups
    if layout == "out_in":
        return weight_shape[0]
    return weight_shape[1]


def fold_into_producer(
    weight: np.ndarray,
    bias: np.ndarray | None,
    scale: np.ndarray,
    shift: np.ndarray,
    layout: WeightLayout,
    groups: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Fold a BN that consumes a linear layer's output into that layer's weight and bias.

    Returns ``(weight', bias')`` with ``BN(layer(x)) == layer'(x)``; ``bias'`` is 1-D.
    """
    w = np.asarray(weight, dtype=np.float64)
    channels = output_channels(w.shape, layout, groups)
    if scale.shape != (channels,):
        raise ValueError(f"BatchNorm has {scale.shape[0]} channels, its producer {channels}")
    b = np.zeros(channels) if bias is None else np.asarray(bias, np.float64).reshape(-1)
    if b.shape != (channels,):
        raise ValueError(f"bias has shape {b.shape}, expected ({channels},)")
    kernel_ones = (1,) * (w.ndim - 2)
    if layout == "conv":
        w_folded = w * scale.reshape((channels, 1) + kernel_ones)
    elif layout == "conv_transpose":
        # (C_in, C_out/g, *k): output channel of [i, j] is (i // (C_in/g)) * (C_out/g) + j.
        c_in, out_per_group = w.shape[0], w.shape[1]
        if c_in % groups:
            raise ValueError(f"ConvTranspose with {c_in} input channels is not divisible by {groups} groups")
        grouped = w.reshape((groups, c_in // groups, out_per_group) + w.shape[2:])
        s = scale.reshape((groups, 1, out_per_group) + kernel_ones)
        w_folded = (grouped * s).reshape(w.shape)
    elif layout == "out_in":
        w_folded = w * scale[:, None]
    else:
        w_folded = w * scale[None, :]
    return w_folded, b * scale + shift


def fold_into_conv_input(
    weight: np.ndarray,
    bias: np.ndarray | None,
    scale: np.ndarray,
    shift: np.ndarray,
    groups: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Fold a BN whose output feeds a convolution (without zero padding) into that conv.

    ``conv(scale * x + shift) == conv'(x)`` holds only where every output position sees
    no zero padding, which is why callers check the padding first.
    """
    w = np.asarray(weight, dtype=np.float64)
    c_out, in_per_group = w.shape[0], w.shape[1]
    if scale.shape != (in_per_group * groups,):
        raise ValueError(f"BatchNorm has {scale.shape[0]} channels, the conv reads {in_per_group * groups}")
    if c_out % groups:
        raise ValueError(f"conv with {c_out} output channels is not divisible by {groups} groups")
    group_of_output = np.arange(c_out) // (c_out // groups)
    input_channel = group_of_output[:, None] * in_per_group + np.arange(in_per_group)[None, :]
    kernel_ones = (1,) * (w.ndim - 2)
    s = scale[input_channel].reshape((c_out, in_per_group) + kernel_ones)
    t = shift[input_channel].reshape((c_out, in_per_group) + kernel_ones)
    b = np.zeros(c_out) if bias is None else np.asarray(bias, np.float64).reshape(-1)
    if b.shape != (c_out,):
        raise ValueError(f"bias has shape {b.shape}, expected ({c_out},)")
    bias_folded = b + (w * t).reshape(c_out, -1).sum(axis=1)
    return w * s, bias_folded
