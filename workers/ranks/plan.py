"""What every rank of a job needs to know, in one small picklable object."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.data import DatasetSpec
from workers.data.loader import LoaderSpec
from workers.engine.calibration import StopRule
from workers.engine.evaluation import EvalTarget
from workers.models.sources import ModelSource


@dataclass(frozen=True)
class EvalPlan:
    """The evaluation after calibration: its data, labels (or None) and what to measure."""

    dataset: DatasetSpec
    labels: np.ndarray | None
    target: EvalTarget
    batch_size: int


@dataclass(frozen=True)
class RankPlan:
    """The job as one rank sees it (identical for every rank but ``rank``-specific fields).

    ``dataset`` is a described file or prefix, or (``bnrecal.recalibrate``) a
    :class:`~workers.data.loader.LoaderSpec` whose batches ``feed`` gives the model.
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
