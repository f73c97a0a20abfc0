"""What a rank actor streams to the driver while it works (``CalibrationRank.run`` and
``onnx_pass``), typed: ``RankStarted`` once it has built the model and joined the group,
``RankProgress`` per step or batch, ``RankHeartbeat`` while a batch or a collective is in
flight, then its result (``CalibrationDone`` or ``OnnxPassDone``). The driver's followers
(``workers.ranks.group``, ``workers.ranks.ort.group``) time a rank out on them: a rank is
stuck when the collectives it entered stop growing, not when its pass is long."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from bnrecal.workers.engine.statistics_pass import Convergence
from bnrecal.workers.engine.evaluation import EvalMetrics, EvalTarget
from bnrecal.workers.engine.moments import MomentStats


@dataclass(frozen=True)
class RankStarted:
    """The rank built its model, opened its data and joined the collective group."""

    rank: int
    node_id: str


@dataclass(frozen=True)
class RankProgress:
    """Samples the rank read since its last event, in ``phase`` (``calibrating``,
    ``evaluating``, or an ONNX pass's batches), its step where the phase counts steps, and
    the collectives it has entered so far."""

    rank: int
    samples: int
    calls: int
    phase: str = "calibrating"
    step: int | None = None


@dataclass(frozen=True)
class RankHeartbeat:
    """The rank is alive, quiet for a while: the collectives it has entered so far."""

    rank: int
    calls: int


@dataclass(frozen=True)
class CalibrationDone:
    """A rank's calibration pass (and evaluation) finished: what the driver's ``GroupResult``
    is made of. ``stats`` (every layer's statistics) come from rank 0 only; ``head`` are the
    first samples of the order this rank read, by their row."""

    rank: int
    node_id: str
    steps: int
    samples: int
    collectives: int
    collectives_total: int
    calls: list[int]
    seconds: float
    memory_format: str
    stats: list[MomentStats] | None
    convergence: Convergence | None
    evaluation: EvalMetrics | None
    head: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    eval_target: EvalTarget | None = None  # rank 0: what the plan's checks found the evaluation measures


@dataclass(frozen=True)
class OnnxPassDone:
    """A rank's onnxruntime pass finished: its ``OnnxPassResult``."""

    rank: int
    node_id: str
    result: Any


RankEvent = RankStarted | RankProgress | RankHeartbeat | CalibrationDone | OnnxPassDone
"""Anything a rank's event stream yields."""
