"""The allreduce the calibration math combines moments with, as an interface.

``Collective`` is what a pass is handed: the real one is the ranks' ``RayCollective``
(``workers.ranks.process.ray_collective``), or ``ProcessGroupCollective`` inside a caller's own
``torch.distributed`` job; ``SingleProcessCollective`` is the world of one, for running the
calibration math in a plain process (tests, references, a one-worker run).
"""

from __future__ import annotations

from typing import Any, Protocol

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


class ProcessGroupCollective:
    """A ``torch.distributed`` process group's SUM allreduce: the ranks of the caller's own
    training job (DDP, torchrun), combining each BN call's moments over the group, as the
    Ray ranks' collective does over theirs. ``group`` None is the default (world) group.

    Under NCCL a tensor crosses on the rank's CUDA device (moved there and back when it is
    not on one); under GLOO it stays where it is."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
        self._dist = dist
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self.calls = 0
        self._device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None

    def allreduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place across the group (counted on entry, as the Ray ranks' are)."""
        self.calls += 1
        if self._device is None or tensor.device == self._device:
            self._dist.all_reduce(tensor, group=self.group)
            return
        moved = tensor.to(self._device)
        self._dist.all_reduce(moved, group=self.group)
        tensor.copy_(moved)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order: for what the ranks must agree
        on besides moments (a failure before the pass, the report rank 0 made)."""
        values: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(values, value, group=self.group)
        return values
