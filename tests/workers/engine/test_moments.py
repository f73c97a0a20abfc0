"""A batch's moments (workers.engine.moments.batch_moments): exact to float64 rounding in
every layout, and measured in at most two kernel calls however large the input, so that a
busy machine's threads are waited for once a layer call, not hundreds of times."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from bnrecal.workers.engine.moments import batch_moments


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance per channel, computed in float64 from the values themselves."""
    values = x.double().movedim(1, 0).reshape(x.shape[1], -1)
    return values.mean(1), values.var(1, unbiased=False)


def assert_exact(x: torch.Tensor) -> None:
    """Within 1e-6 of a channel's std on the mean and 5e-6 relative on the variance: one
    float32 sum over a stem layer's 100,352 values per channel misses both (2.5e-6 and 5.7e-5)."""
    moments = batch_moments(x)
    mean, var = reference(x)
    assert ((moments.mean - mean).abs() / var.sqrt()).max().item() < 1e-6
    assert ((moments.var - var) / var).abs().max().item() < 5e-6


def kernel_calls(x: torch.Tensor) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        batch_moments(x)
    return sum(event.count for event in prof.key_averages() if event.key == "aten::batch_norm_update_stats")


CASES = {  # shape, layout: resnet18's first BN input at batch 8, a late layer, BatchNorm1d, a 3-D volume
    "stem channels-last": ((8, 64, 112, 112), torch.channels_last),
    "late channels-last": ((8, 256, 14, 14), torch.channels_last),
    "stem contiguous": ((8, 64, 112, 112), torch.contiguous_format),
    "1-D features": ((5000, 16), None),
    "volume channels-last": ((2, 8, 12, 40, 40), torch.channels_last_3d),
}


@pytest.mark.parametrize("case", CASES)
def test_moments_are_exact_in_few_kernel_calls(case):
    shape, layout = CASES[case]
    torch.manual_seed(0)
    x = torch.randn(*shape) * 2 + 0.5
    if layout is not None:
        x = x.contiguous(memory_format=layout)
    assert_exact(x)
    assert kernel_calls(x) <= 2, "one kernel call per chunk: a parallel region each, waited for on a busy machine"


def test_a_strided_input_is_still_exact():
    assert_exact(torch.randn(6, 10, 30, 30)[:, ::2, :, ::3])  # neither contiguous nor channels-last
