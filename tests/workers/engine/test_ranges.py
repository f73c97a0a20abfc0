"""The range math the ranks combine: min/max and histograms that do not depend on how the
values were split into batches or ranks, and the one-hot packing of min/max into a SUM."""

from __future__ import annotations

import numpy as np
import torch

from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.workers.engine.ranges import HistogramAccumulator, MinMaxAccumulator, TensorRanges


class SummingWorld:
    """K ranks' buffers summed, as a SUM allreduce leaves them: every rank's call is made
    first (each on its own copy), then each sees the sum."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.calls = 0
        self.buffers: list[torch.Tensor] = []

    def allreduce(self, tensor: torch.Tensor) -> None:
        self.calls += 1
        self.buffers.append(tensor.clone())


def test_one_hot_slots_summed_give_the_global_min_and_max_with_an_empty_rank():
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(50).astype(np.float32) * scale for scale in (1.0, 5.0, 0.1)]
    world = SummingWorld(4)
    parts = [np.array_split(v, 3) + [np.zeros(0, np.float32)] for v in values]  # rank 3 sees nothing
    for rank in range(4):
        local = MinMaxAccumulator(["a", "b", "c"])
        for index in range(3):
            local.add(index, parts[index][rank])
        local.combine(world, rank)
    summed = torch.stack(world.buffers).sum(dim=0)
    low = summed[:, 0].min(dim=0).values.numpy().astype(np.float32)
    high = summed[:, 1].max(dim=0).values.numpy().astype(np.float32)
    assert np.array_equal(low, [v.min() for v in values]) and np.array_equal(high, [v.max() for v in values])


def test_nan_is_ignored_and_a_world_of_one_is_the_identity():
    local = MinMaxAccumulator(["x"])
    local.add(0, np.array([np.nan, 2.0, -3.0], dtype=np.float32))
    combined = local.combine(SingleProcessCollective(), 0)
    assert combined.low[0] == -3.0 and combined.high[0] == 2.0
    assert combined.pairs()["x"][0].dtype == np.float32 and combined.pairs()["x"][0].shape == (1,)


def test_histograms_do_not_depend_on_the_split():
    rng = np.random.default_rng(1)
    data = (rng.standard_normal(10_000) * 3).astype(np.float32)
    ranges = TensorRanges(("x",), np.array([data.min()]), np.array([data.max()]))
    for absolute in (False, True):
        whole = HistogramAccumulator(ranges, 128, absolute)
        whole.add(0, data)
        pieces = HistogramAccumulator(ranges, 128, absolute)
        for part in np.array_split(data, 7):
            pieces.add(0, part)
        assert np.array_equal(whole.counts, pieces.counts) and whole.counts.sum() == data.size
        assert whole.edges(0)[0] == (0.0 if absolute else -np.abs(data).max())
