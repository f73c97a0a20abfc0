"""What every rank of a job needs to know, in one small picklable object."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from bnrecal.workers.data import DatasetSpec
from bnrecal.workers.data.formats.loader import LoaderSpec
from bnrecal.workers.engine.statistics_pass import Convergence, StopRule
from bnrecal.workers.engine.evaluation import EvalMetrics, EvalTarget
from bnrecal.workers.engine.moments import MomentStats
from bnrecal.workers.models.sources import ModelSource

if TYPE_CHECKING:
    import torch

    from bnrecal.workers.ranks.ort.rank_pass import OnnxPassResult


@dataclass(frozen=True)
class EvalPlan:
    """The evaluation after calibration: its data, labels (or None) and what to measure.

    ``target`` None: not decided yet; the model's output on ``probe`` (the first sample)
    decides it, on the job's host before the ranks start, or on the ranks (``ModelChecks``)."""

    dataset: DatasetSpec
    labels: np.ndarray | None
    target: EvalTarget | None
    batch_size: int
    probe: torch.Tensor | None = None


@dataclass(frozen=True)
class ModelChecks:
    """The checks a job's host makes on its model before any rank starts, made by every rank
    on its own copy instead where the ranks are up already (a sweep's cells, docs/sweeps.md,
    "What is shared"): the BN layers' call order on ``probe`` (the first calibration batch,
    as the ranks feed it), and with ``eval_probe`` what the evaluation can measure on the
    model's output (with ``labels``). The same functions, so the same errors."""

    probe: Any
    eval_probe: torch.Tensor | None = None
    labels: np.ndarray | None = None


@dataclass(frozen=True)
class RankPlan:
    """The job as one rank sees it (identical for every rank but ``rank``-specific fields).

    ``dataset`` is a described file or prefix, or (``bnrecal.recalibrate``) a
    :class:`~workers.data.formats.loader.LoaderSpec` whose batches ``feed`` gives the model.
    """

    model: ModelSource
    dataset: DatasetSpec | LoaderSpec
    batch_size: int
    mode: str
    world_size: int
    device: str
    backend: str
    group_name: str
    layer_names: tuple[str, ...]
    call_order: tuple[int, ...]
    loader_workers: int = 0
    memory_format: str = "auto"
    evaluation: EvalPlan | None = None
    feed: Callable[[Any, Any], Any] | None = None  # forward(model, batch), for a LoaderSpec's batches
    stop: StopRule | None = None  # max_samples "auto": stop once the statistics have converged
    head: int = 0  # the first samples of the order, as read, handed back (an export's checks run on them)
    checks: ModelChecks | None = None  # made on the rank before its pass (``call_order`` is then empty)


@dataclass
class GroupResult:
    """What the ranks of a job produced together (also a one-rank run in the calling
    process, ``workers.ranks.process.work``)."""

    stats: list[MomentStats]
    steps: int
    samples: int
    collectives: list[int]
    seconds: float
    nodes: list[str]
    calls: list[int] = field(default_factory=list)
    memory_formats: list[str] = field(default_factory=list)
    evaluation: EvalMetrics | None = None
    convergence: Convergence | None = None  # with a stop rule: where it ended
    head: torch.Tensor | None = None  # the first ``RankPlan.head`` samples the ranks read, in order
    eval_target: EvalTarget | None = None  # what ``RankPlan.checks`` found the evaluation measures


@dataclass(frozen=True)
class GroupOptions:
    """How to place and supervise the ranks of one job."""

    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    placement_strategy: str = "SPREAD"
    collective_timeout_s: float = 300.0
    placement_timeout_s: float = 120.0


@dataclass
class GroupPass:
    """What the ranks of an onnxruntime pass found together (``workers.ranks.ort.rank_pass``):
    rank 0's combined result (every rank holds the same), the samples each rank read, the
    collectives each made, and their nodes."""

    result: OnnxPassResult
    samples: list[int]
    collectives: list[int]
    nodes: list[str]
    seconds: float
