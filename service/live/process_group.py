"""``bnrecal.recalibrate(..., process_group=group)``: recalibrate inside the caller's own
``torch.distributed`` job (DDP, torchrun), on its ranks (docs/training.md).

Every rank of the group makes the same call with its own data; each BN call's moments are
combined over the group, one allreduce per BN call per step, as bnrecal's Ray ranks combine
theirs, so every rank ends with the statistics of the global batch of every step (SyncBN's),
and the same report. Nothing is started: no Ray, no server, no process.

- Data each rank owns (a DataLoader over its ``DistributedSampler`` shard, any iterable of
  batches): its batches are its part of each step; the ranks agree step by step who still
  has a batch, so uneven shards work, a rank whose data ran out taking part in the others'
  steps with an empty one.
- Data every rank gives alike (a path, a map-style Dataset or tensor with ``batch_size``):
  split between the ranks as the Ray ranks split it, each sample counted once.
- A rank that fails before the pass (its data, its options) makes every rank fail with its
  error; one that fails during the pass leaves the others waiting in a collective until the
  group's timeout (``init_process_group(timeout=...)``), which then fails them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from bnrecal.errors import BnrecalError, SpecError, first_line
from bnrecal.workers.engine.collective import ProcessGroupCollective

from bnrecal.service.run.executors import ProcessGroupRanks
from bnrecal.service.run.options import RecalibrationOptions

from .data import is_path_data
from .report import RecalibrationReport


def job_group(
    process_group: Any, data: Any, asked: RecalibrationOptions, *, ray_address: str | None, server: str | None,
) -> ProcessGroupRanks | None:
    """The executor of a call inside the caller's group, or None without one (with a warning
    where ``torch.distributed`` runs several ranks: each recalibrates alone then). What does
    not go with a group is refused before any work."""
    if process_group is None:
        _warn_if_distributed()
        return None
    for name, value in (("workers", asked.workers != 1), ("ray_address", ray_address), ("server", server)):
        if value:
            raise SpecError(f"{name} does not go with process_group: the group's own ranks are the workers",
                            field="process_group")
    try:
        collective = ProcessGroupCollective(process_group)
    except (RuntimeError, ValueError) as error:
        raise SpecError(f"process_group: {first_line(error)}", field="process_group") from None
    return ProcessGroupRanks(collective, split=splits_between_ranks(data))


def splits_between_ranks(data: Any) -> bool:
    """Whether every rank gives the same data, split between them (a path, a map-style
    Dataset or tensor), rather than each its own (a DataLoader, an iterable of batches)."""
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    if is_path_data(data):
        return True
    if isinstance(data, DataLoader):
        return False
    return isinstance(data, (torch.Tensor,)) or (isinstance(data, Dataset) and not isinstance(data, IterableDataset))


def unwrapped(model: Any) -> Any:
    """The module a ``DistributedDataParallel`` (or ``DataParallel``) wraps: its BN buffers
    are the wrapper's, and the wrapper's forward would sync buffers on the group mid-pass."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def agreed_report(report: RecalibrationReport, ranks: ProcessGroupRanks, own_data: bool) -> RecalibrationReport:
    """Rank 0's report on every rank (bit-identical), its data section the group's where each
    rank read its own data."""
    report.world_size = ranks.collective.world_size
    if own_data and report.data is not None:
        report.data.samples, report.data.steps = report.samples, report.steps
        report.data.total_samples = None
    first = ranks.collective.gather(report.to_dict() if ranks.collective.rank == 0 else None)[0]
    return RecalibrationReport.from_dict(first)


def fail_together(ranks: ProcessGroupRanks | None, error: BaseException) -> None:
    """Where this rank failed before its pass, tell the others (they fail too, not wait)."""
    if ranks is not None and not ranks.gated and isinstance(error, (BnrecalError, ValueError, TypeError, RuntimeError)):
        ranks.gate(error)


def _warn_if_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            f"torch.distributed runs {dist.get_world_size()} ranks but recalibrate got no process_group: this rank "
            "recalibrates on its own data alone (each rank its own statistics); pass "
            "process_group=torch.distributed.group.WORLD to combine them (docs/training.md)",
            stacklevel=3,
        )
