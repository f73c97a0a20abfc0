"""The allreduce the calibration math combines moments with, as an interface.

``Collective`` is what a pass is handed: the real one is the ranks' ``RayCollective``
(``workers.ranks.collectives``); ``SingleProcessCollective`` is the world of one, for
running the calibration math in a plain process (tests, references, a one-worker run).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Collective(Protocol):
    """A SUM allreduce over the job's ranks, counting its calls."""

    calls: int
    world_size: int

    def allreduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place across every rank."""
        ...


class SingleProcessCollective:
    """The world of one rank: every allreduce is the identity, still counted."""

    world_size = 1

    def __init__(self) -> None:
        self.calls = 0

    def allreduce(self, tensor: torch.Tensor) -> None:
        """Sum across a world of one: nothing to combine."""
        self.calls += 1
