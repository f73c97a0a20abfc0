"""``bnrecal.recalibrate_many``: a sweep from Python (docs/sweeps.md, "From Python").

Many live models (any iterable, consumed one model at a time: a generator of 1,000 subnets
is never held at once) over one dataset or several named ones. Each cell (a model and a
set) is exactly ``bnrecal.recalibrate`` of that model on that set; what the cells share is
below them (``service.run.shared``): the Ray ranks start once, and the samples a path's
data decodes are kept for the next model over the same set.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bnrecal.errors import BnrecalError, CancelledError, SpecError
from bnrecal.workers.ranks.gangs.warm_context import current_pool

from bnrecal.service.run.core import KeepBudget
from bnrecal.service.run.executors import InProcess, RayRanks
from bnrecal.service.run.options import RecalibrationOptions
from bnrecal.service.run.shared import SharedRanks
from bnrecal.service.sweep.cells import CellStatus, check_name

from .report import RecalibrationReport
from .run import (
    Forward, LiveRun, call_settings, live_options, prepare_data, progress_display, run_live, run_options, runs_here,
)

if TYPE_CHECKING:
    from .run import PreparedData


@dataclass(frozen=True)
class CellResult:
    """One cell of ``recalibrate_many``: the model's index in the iterable, the set's name,
    and either the report and the statistics (the model's BN buffers after this cell, by
    its state-dict keys) or the error that failed this cell alone."""

    model_index: int
    set_name: str
    status: CellStatus
    report: RecalibrationReport | None = None
    statistics: dict[str, torch.Tensor] | None = None
    error: BnrecalError | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the cell succeeded."""
        return self.status is CellStatus.SUCCEEDED


def recalibrate_many(
    models: Iterable[nn.Module | torch.export.ExportedProgram],
    data: Any,
    options: RecalibrationOptions | None = None,
    *,
    forward: Forward | None = None,
    ray_address: str | None = None,
    progress: bool = False,
    **overrides: Any,
) -> Iterator[CellResult]:
    """Recalibrate every model of ``models`` in place on ``data`` (one dataset, or a dict of
    named datasets: the cells are every model over every set, model by model), yielding one
    :class:`CellResult` per cell as it finishes.

    Each cell is exactly ``bnrecal.recalibrate(model, set, options, **overrides)`` (the same options,
    the same statistics); with several sets a model's statistics are its last set's, and
    each cell's ``statistics`` hold its own. ``models`` is read one model at a time. A
    cell that fails (a model without BatchNorm, one the data does not fit) is yielded with
    its ``error`` and the sweep goes on; every dataset is described and checked before
    the first cell. The Ray ranks (``workers`` > 1 or ``ray_address``) start once for the
    sweep, and the samples a path's data decodes are kept for the next model (docs/sweeps.md).
    Bad options and data are refused at the call; nothing runs until the first cell is
    asked for. Stop early by leaving the loop: the ranks are let go.
    """
    pool, asked = current_pool(), live_options(options, overrides, "recalibrate_many")
    settings, run = call_settings(asked), run_options(asked)
    named = _named_sets(data)
    prepared: dict[str, PreparedData] = {
        name: prepare_data(value, asked, run, forward, settings) for name, value in named.items()
    }
    here = runs_here(run, pool, ray_address)
    inner = InProcess() if here else RayRanks(
        settings, address=ray_address, pool=pool, stop_embedded=True, placement=run.placement,
    )
    shared = SharedRanks(inner, KeepBudget.from_megabytes(settings.kept_memory_mb, settings.kept_disk_mb))
    return _cells(models, prepared, LiveRun(forward, settings, shared, here, ray_address, keep=shared.keep), progress)


def _cells(models: Iterable[Any], prepared: dict[str, PreparedData], where: LiveRun, progress: bool) -> Iterator[CellResult]:
    """The cells, model by model, on the shared ranks (``where.executor``), started for the
    first cell when it is asked for."""
    shared = where.executor
    assert isinstance(shared, SharedRanks)
    try:
        for index, model in enumerate(models):
            first = statistics_buffers(model)
            before = {key: value.detach().clone() for key, value in first.items()}
            for number, (name, ready) in enumerate(prepared.items()):
                if number:  # each cell from the model as given: num_batches_tracked counts one set's steps
                    with torch.no_grad():
                        for key, value in before.items():
                            first[key].copy_(value)
                yield _cell(index, name, model, ready, replace(where, shared=shared.shared_scope(name)), progress)
    finally:
        shared.finish()


def _cell(index: int, name: str, model: Any, data: PreparedData, where: LiveRun, progress: bool) -> CellResult:
    """One cell, its failure its own (a cancellation or an interrupt ends the sweep)."""
    started = time.monotonic()
    try:
        if not isinstance(model, (nn.Module, torch.export.ExportedProgram)):
            raise SpecError(f"models[{index}] is a {type(model).__name__}, not an nn.Module or ExportedProgram",
                            field=f"models[{index}]")
        with progress_display(progress, f"[model {index}, {name}] starting workers") as update:
            report, updates = run_live(model, data, where, update)
    except CancelledError:
        raise
    except BnrecalError as exc:
        return CellResult(index, name, CellStatus.FAILED, error=exc, seconds=time.monotonic() - started)
    statistics = {key: value.detach().clone() for key, value in updates.items()}  # this cell's, not the next's
    return CellResult(index, name, CellStatus.SUCCEEDED, report, statistics, seconds=time.monotonic() - started)


STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def statistics_buffers(model: Any) -> dict[str, torch.Tensor]:
    """The model's BN statistics buffers, by state-dict key (the tensors themselves)."""
    if isinstance(model, torch.export.ExportedProgram):
        buffers = dict(model.state_dict)
    elif isinstance(model, nn.Module):
        buffers = dict(model.named_buffers())
    else:
        return {}
    return {key: value for key, value in buffers.items() if key.rsplit(".", 1)[-1] in STATISTICS}


def _named_sets(data: Any) -> dict[str, Any]:
    """``data`` as {set name: dataset}: a dict of named datasets as given, else one set ``data``."""
    if isinstance(data, Mapping) and data and all(isinstance(key, str) for key in data):
        sets = dict(data)
        for key in sets:
            check_name(key, "set", f"data[{key!r}]")
        return sets
    if isinstance(data, Mapping):
        raise SpecError("data: give one dataset, or a dict of named datasets {name: dataset}", field="data")
    return {"data": data}
