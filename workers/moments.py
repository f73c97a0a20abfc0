"""Shifted float64 moments of BatchNorm inputs, the quantity ranks sum in a collective.

A layer's moments are packed in one float64 vector ``[n, S1[0..C), S2[0..C)]`` with
``S1 = sum(x - c)`` and ``S2 = sum((x - c)^2)`` per channel, where the shift ``c`` is the
layer's old running mean (contract section 1). Packing the count and both sums in one
tensor is what lets a step synchronise a layer with a single allreduce, and what lets
``local`` mode send every layer in one buffer: moments of disjoint sets simply add.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MomentStats:
    """Mean and biased variance of a set of values, per channel, in float64."""

    count: float
    mean: torch.Tensor
    var: torch.Tensor

    @property
    def unbiased_var(self) -> torch.Tensor:
        """The (n - 1) variance, what BatchNorm keeps as ``running_var``."""
        if self.count <= 1:
            return self.var.clone()
        return self.var * (self.count / (self.count - 1.0))


class ScratchSpace:
    """Reusable float buffers, grown on demand and shared by every layer of a pass.

    Layers run one after another, so buffers the size of the largest BN input
    serve all of them; reusing it avoids paging in a fresh allocation per layer per
    step, which costs more than the arithmetic on this kind of machine.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def like(self, x: torch.Tensor, slot: str) -> torch.Tensor:
        """A tensor shaped like ``x`` backed by the buffer named ``slot``."""
        buffer = self._buffers.get(slot)
        if (
            buffer is None
            or buffer.numel() < x.numel()
            or buffer.dtype != x.dtype
            or buffer.device != x.device
        ):
            buffer = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
            self._buffers[slot] = buffer
        return buffer[: x.numel()].view(x.shape)


def packed_size(channels: int) -> int:
    """Length of one layer's packed moment vector."""
    return 1 + 2 * channels


def reduce_dims(x: torch.Tensor) -> tuple[int, ...]:
    """Every dimension of a BN input except the channel dimension (1)."""
    return (0,) + tuple(range(2, x.dim()))


def shifted_moments(
    x: torch.Tensor, shift: torch.Tensor, scratch: ScratchSpace
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed moments of ``x`` about ``shift`` (float64), plus the step's centred input.

    Returns ``(packed, centred, step_mean)``: ``centred`` is ``x`` minus the batch's own
    float32 mean ``step_mean`` (a view of the scratch buffer, valid until the next
    call), from which the caller normalises without losing precision when
    ``|mean| >> std``. Sums run in the input's dtype over values already centred
    near zero, then move to the common shift in float64, which keeps the variance
    exact to float32 rounding of the deviations, not of the raw values.
    """
    channels = x.shape[1]
    n = x.numel() // channels if channels else 0
    packed = torch.zeros(packed_size(channels), dtype=torch.float64, device=x.device)
    if n == 0:
        return packed, x, torch.zeros(channels, dtype=x.dtype, device=x.device)
    dims = reduce_dims(x)
    view_shape = (1, channels) + (1,) * (x.dim() - 2)
    step_mean = x.sum(dims) / n
    centred = scratch.like(x, "centred")
    torch.sub(x, step_mean.view(view_shape), out=centred)
    first = centred.sum(dims).double()
    squares = torch.mul(centred, centred, out=scratch.like(x, "squares"))
    second = squares.sum(dims).double()
    delta = step_mean.double() - shift
    packed[0] = n
    packed[1 : 1 + channels] = first + n * delta
    packed[1 + channels :] = second + 2.0 * delta * first + n * delta * delta
    return packed, centred, step_mean


def finalize(packed: torch.Tensor, shift: torch.Tensor) -> MomentStats:
    """Mean and biased variance from packed moments about ``shift``."""
    channels = (packed.numel() - 1) // 2
    n = float(packed[0].item())
    if n <= 0:
        zeros = torch.zeros(channels, dtype=torch.float64, device=packed.device)
        return MomentStats(0.0, shift.clone(), zeros)
    first = packed[1 : 1 + channels] / n
    second = packed[1 + channels :] / n
    var = (second - first * first).clamp_min(0.0)
    return MomentStats(n, shift + first, var)
