"""The ranks' real allreduce: a ``ray.util.collective`` group per job, GLOO for CPU
actors and NCCL for CUDA actors, behind the engine's ``Collective`` interface
(``workers.engine.collective``).
"""

from __future__ import annotations

import torch


def backend_for_device(device: str) -> str:
    """NCCL where actors compute on CUDA, GLOO on CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


class RayCollective:
    """A ``ray.util.collective`` group joined from inside an actor."""

    def __init__(self, world_size: int, rank: int, backend: str, group_name: str) -> None:
        from ray.util import collective

        self._collective = collective
        self.world_size = world_size
        self.rank = rank
        self.backend = backend
        self.group_name = group_name
        self.calls = 0
        collective.init_collective_group(world_size, rank, backend=backend.upper(), group_name=group_name)

    def allreduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place across the group.

        The call is counted on entry, so while ranks wait on each other the one that
        has entered fewer collectives is the one holding the others up.
        """
        self.calls += 1
        self._collective.allreduce(tensor, group_name=self.group_name)

    def close(self) -> None:
        """Leave the group and release its communicator."""
        if self._collective.is_group_initialized(self.group_name):
            self._collective.destroy_collective_group(self.group_name)
