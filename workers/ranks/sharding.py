"""The deterministic sharding rule (docs/calibration.md, "Sharding")."""

from __future__ import annotations

import math

import numpy as np


def num_steps(num_samples: int, batch_size: int) -> int:
    """Global steps needed to cover ``num_samples`` at global batch ``batch_size``."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    return math.ceil(num_samples / batch_size)


def rank_ranges(num_samples: int, batch_size: int, world_size: int, rank: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` sample range rank ``rank`` takes at every global step.

    Step ``j`` covers samples ``[j*B, min((j+1)*B, N))``; rank ``k`` takes the k-th part
    of ``numpy.array_split`` of those indices into ``world_size`` parts. Every rank gets
    an entry for every step, empty ones included, so all ranks run the same number of
    steps and their collectives always pair up.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    ranges: list[tuple[int, int]] = []
    for step in range(num_steps(num_samples, batch_size)):
        start = step * batch_size
        stop = min(start + batch_size, num_samples)
        part = np.array_split(np.arange(start, stop), world_size)[rank]
        ranges.append((int(part[0]), int(part[-1]) + 1) if part.size else (start, start))
    return ranges


def step_ranges(num_samples: int, batch_size: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` sample range of every global step: ``[j*B, min((j+1)*B, N))``."""
    return [
        (step * batch_size, min((step + 1) * batch_size, num_samples))
        for step in range(num_steps(num_samples, batch_size))
    ]
