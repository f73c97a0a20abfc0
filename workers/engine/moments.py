"""Float64 moments of BatchNorm inputs, the quantity ranks sum in a collective.

A layer's moments are packed in one float64 vector ``[n, S1[0..C), S2[0..C)]`` with
``S1 = sum(x - c)`` and ``S2 = sum((x - c)^2)`` per channel, where the shift ``c`` is the
layer's old running mean (docs/calibration.md, "Numerics"). Packing the count and both sums in one
tensor is what lets a step synchronise a layer with a single allreduce, and what lets
``local`` mode send every layer in one buffer: moments of disjoint sets simply add.

A batch's own mean and biased variance come from torch's batch-norm statistics kernel
(one pass over the input, in the input's dtype) and are moved to the shift in float64.
That kernel is accurate on the default layout, where it sums each channel's plane with
vector accumulators; in channels-last layout (and on 2-D input) it adds a channel's values
one by one into one float32 accumulator per thread, which loses about 1e-4 relative over
a few hundred thousand values. There each channel's values are dealt into interleaved
groups of at most ``CHUNK_VALUES`` values, all measured side by side in one kernel call
(the input viewed as ``(values / groups, groups * channels)``, no copy) and combined in
float64: the same single pass over memory, each sum short enough to stay exact to about
1e-7 (as on the default layout; with blocks of 16384 values, a few 1e-6 per layer added up
to 5e-5 four layers down). One call, not one per block: each call is an OpenMP parallel
region, and on a machine whose cores are busy with other work each region waits for all
its threads (hundreds of blocks a layer call made a pass several times slower there).
The CUDA kernel merges per-thread Welford sums in a tree in every layout, so a CUDA input
is measured in one call (chunks there cost a launch each: 900 for one resnet50 layer). Where a channel's mean
dwarfs its spread, float32 statistics of the raw values lose the variance, so such a
batch is measured again about its own mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FAR_FROM_ZERO = 16.0
"""|mean| / std above which a batch is re-measured about its own mean: below it the
float32 kernel's error on the mean and the variance stays under about 1e-5 (std units)."""

CHUNK_VALUES = 2048
"""Values per channel measured by one kernel call where the kernel sums them one by one."""


@dataclass
class MomentStats:
    """Mean and biased variance of a set of values, per channel, in float64.

    ``se_mean`` (in units of the channel's std) and ``se_var`` (relative) are the standard
    errors of the mean and variance per channel when they were estimated (see
    :func:`standard_errors`), else None.
    """

    count: float
    mean: torch.Tensor
    var: torch.Tensor
    se_mean: torch.Tensor | None = None
    se_var: torch.Tensor | None = None

    @property
    def unbiased_var(self) -> torch.Tensor:
        """The (n - 1) variance, what BatchNorm keeps as ``running_var``."""
        if self.count <= 1:
            return self.var.clone()
        return self.var * (self.count / (self.count - 1.0))


@dataclass
class BatchMoments:
    """One call's statistics: the batch mean and biased variance, and the base they are
    measured from (``base`` is zero unless the input was re-centred, then ``centred``
    holds ``x - base`` for normalising without losing precision)."""

    count: int
    mean: torch.Tensor
    var: torch.Tensor
    base: torch.Tensor | None = None
    centred: torch.Tensor | None = None


def packed_size(channels: int) -> int:
    """Length of one layer's packed moment vector."""
    return 1 + 2 * channels


def batch_moments(x: torch.Tensor) -> BatchMoments:
    """Mean and biased variance per channel (dimension 1) of one BN input, in float64.

    One statistics pass in the common case; a second pass over ``x - mean`` only for
    channels far from zero relative to their spread, where float32 statistics of the raw
    values would be off (docs/calibration.md, "Numerics").
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    if count == 0:
        zeros = torch.zeros(channels, dtype=torch.float64, device=x.device)
        return BatchMoments(0, zeros, zeros.clone())
    mean, var = _statistics(x)
    if not _far_from_zero(mean, var):
        return BatchMoments(count, mean, var)
    base = mean.to(x.dtype)
    centred = x - base.view((1, channels) + (1,) * (x.dim() - 2))
    residual, var = _statistics(centred)
    base64 = base.double()
    return BatchMoments(count, base64 + residual, var, base=base64, centred=centred)


def _statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance per channel in float64, in one pass over ``x``."""
    if x.is_cuda or (x.dim() > 2 and x.is_contiguous()):
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
        return mean.double(), var.double()
    rows = _channel_rows(x)
    if rows is None:  # neither layout: an odd stride, measured chunk by chunk
        chunks = _chunks(x)
        return _combined([(torch.batch_norm_update_stats(c, None, None, 0.0), c.numel() // c.shape[1]) for c in chunks])
    return _combined(_interleaved(rows))


def _channel_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as a (values, channels) matrix without a copy: a 2-D input, or channels-last
    (each position's channels side by side in memory); None for any other layout."""
    rows = x if x.dim() == 2 else x.movedim(1, -1)
    if not rows.is_contiguous():
        return None
    return rows.reshape(-1, x.shape[1])


def _interleaved(rows: torch.Tensor) -> list[tuple[tuple[torch.Tensor, torch.Tensor], int]]:
    """The statistics of ``rows`` (values x channels) in at most two kernel calls, each sum
    over at most ``CHUNK_VALUES`` values: the rows are dealt into ``groups`` interleaved
    groups (row ``i`` to group ``i % groups``) by viewing them as ``(rows / groups, groups *
    channels)``, so one call measures every group of every channel side by side; the rows
    left over are one more call. One call, not one per chunk: each call is a parallel
    region, which waits for every thread of a busy machine (224 calls a step for resnet18's
    first layer cost 174-750 ms there, against 14-28 ms in one)."""
    total, channels = rows.shape
    groups = -(-total // CHUNK_VALUES)
    if groups == 1:
        return [(torch.batch_norm_update_stats(rows, None, None, 0.0), total)]
    main = (total // groups) * groups
    mean, var = torch.batch_norm_update_stats(rows[:main].reshape(main // groups, groups * channels), None, None, 0.0)
    parts = [((m, v), main // groups) for m, v in zip(mean.view(groups, channels), var.view(groups, channels))]
    if main < total:
        parts.append((torch.batch_norm_update_stats(rows[main:], None, None, 0.0), total - main))
    return parts


def _combined(parts: list[tuple[tuple[torch.Tensor, torch.Tensor], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Parts' (mean, biased variance) and counts combined into the whole's, in float64."""
    if len(parts) == 1:
        (mean, var), _ = parts[0]
        return mean.double(), var.double()
    counts = torch.tensor([count for _, count in parts], dtype=torch.float64, device=parts[0][0][0].device).unsqueeze(1)
    means = torch.stack([m for (m, _), _ in parts]).double()
    variances = torch.stack([v for (_, v), _ in parts]).double()
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    var = (counts * (variances + (means - mean) ** 2)).sum(0) / total
    return mean, var


def _chunks(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` cut into blocks of at most about ``CHUNK_VALUES`` values per channel: whole
    samples where they are small, else rows (dimension 2) of one sample."""
    per_sample = x.numel() // (x.shape[0] * x.shape[1])
    if per_sample <= CHUNK_VALUES or x.dim() < 3:
        step = max(1, CHUNK_VALUES // max(1, per_sample))
        return list(torch.split(x, step, dim=0))
    row = per_sample // x.shape[2]
    step = max(1, CHUNK_VALUES // max(1, row))
    return [block for sample in torch.split(x, 1, dim=0) for block in torch.split(sample, step, dim=2)]


def _far_from_zero(mean: torch.Tensor, var: torch.Tensor) -> bool:
    return bool((mean.abs() > FAR_FROM_ZERO * var.sqrt()).any())


def pack(moments: BatchMoments, shift: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``[n, S1, S2]`` about ``shift`` into ``out`` (float64, length ``packed_size``)."""
    channels = shift.numel()
    n = float(moments.count)
    delta = moments.mean - shift
    out[0] = n
    out[1 : 1 + channels] = n * delta
    out[1 + channels :] = n * (moments.var + delta * delta)
    return out


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


ERROR_SLOTS = 5
"""Float64 slots per channel for the standard errors: the sums over steps of S1^2, S2^2,
S1*S2, n*S1 and n*S2 of each step's moments (plus two per layer: steps and sum n^2)."""


def error_size(channels: int) -> int:
    """Length of one layer's packed error sums ``[J, sum n^2, 5 x C]``."""
    return 2 + ERROR_SLOTS * channels


def accumulate_errors(step: torch.Tensor, out: torch.Tensor) -> None:
    """Add one step's packed moments ``[n, S1, S2]`` (the global batch in ``sync`` mode, a
    rank's slice in ``local``) to the error sums ``out``; an empty step adds nothing.

    These are the sums of products the ratio estimator's variance needs (a step is one
    cluster of a cluster sample): like the moments themselves they are sums, so ranks
    combine them with SUM."""
    n = step[0]
    channels = (step.numel() - 1) // 2
    s1, s2 = step[1 : 1 + channels], step[1 + channels :]  # zero, like n, for an empty step
    out[0] += (n > 0).to(out.dtype)
    out[1] += n * n
    slots = out[2:].view(ERROR_SLOTS, channels)
    slots[0] += s1 * s1
    slots[1] += s2 * s2
    slots[2] += s1 * s2
    slots[3] += n * s1
    slots[4] += n * s2


def standard_errors(packed: torch.Tensor, errors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Standard errors of the mean (in std units) and of the variance (relative), per channel.

    Each step's batch is treated as one draw of a cluster sample (true when the samples are
    in a fair, shuffled order): the mean ``sum S1 / sum n`` is a ratio estimator, whose
    variance is ``J/(J-1) * sum_j (S1_j - a n_j)^2 / N^2``; the variance ``b - a^2`` is
    linearised the same way, with residual ``e_j = S2_j - 2a S1_j + (2a^2 - b) n_j`` per step.
    None before two non-empty steps. The sums are about the layer's shift, so precision is
    lost only when the new mean is some 1e4 standard deviations from the old one.
    """
    steps = float(errors[0].item())
    total = float(packed[0].item())
    if steps < 2 or total <= 0:
        return None
    channels = (packed.numel() - 1) // 2
    slots = errors[2:].view(ERROR_SLOTS, channels)
    s11, s22, s12, n1, n2 = slots
    nn = float(errors[1].item())
    a = packed[1 : 1 + channels] / total
    b = packed[1 + channels :] / total
    var = (b - a * a).clamp_min(0.0)
    scale = steps / (steps - 1.0) / (total * total)
    mean_spread = (s11 - 2.0 * a * n1 + a * a * nn).clamp_min(0.0) * scale
    u, w = 2.0 * a, 2.0 * a * a - b
    var_spread = s22 + u * u * s11 + w * w * nn - 2.0 * u * s12 + 2.0 * w * n2 - 2.0 * u * w * n1
    var_spread = var_spread.clamp_min(0.0) * scale
    se_mean = _ratio(mean_spread.sqrt(), var.sqrt())
    se_var = _ratio(var_spread.sqrt(), var)
    return se_mean, se_var


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator``, 0 where both are 0 (a constant channel is known exactly)."""
    out = numerator / denominator
    return torch.where(numerator == 0, torch.zeros_like(out), out)


def worst_standard_error(
    totals: list[torch.Tensor], errors: list[torch.Tensor]
) -> tuple[float, int, str] | None:
    """The largest standard error over every layer's channels: (value, layer index,
    ``mean`` or ``variance``); None while a layer that normalised has fewer than two steps
    (a layer the forward never reached has no statistics to wait for)."""
    worst: tuple[float, int, str] | None = None
    for index, (total, sums) in enumerate(zip(totals, errors)):
        found = standard_errors(total, sums)
        if found is None:
            if float(total[0].item()) <= 0:
                continue
            return None
        for kind, values in zip(("mean", "variance"), found):
            value = float(values.max().item()) if values.numel() else 0.0
            if value != value:  # NaN: not measurable yet
                return None
            if worst is None or value > worst[0]:
                worst = (value, index, kind)
    return worst
