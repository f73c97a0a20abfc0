"""Where a run's onnxruntime passes run (``workers.ranks.ort.rank_pass``), and over which
samples: the calibration samples the statistics came from, with their sharding, or the
evaluation data, with its own (docs/int8.md, "How the ranges are gathered").

:class:`OnnxPasses` is what the INT8 phase (``service.run.outputs.int8``) asks for passes. It knows
the evaluation's labels and whether the evaluation samples are the calibration samples (the
same data given for both, ``workers.data.reading.alignment``): then one pass over them gathers the
FP32 models' ranges and measures them too, each sample's label and part found by its
evaluation position. Where a pass runs is a subclass's: this process
(:class:`InProcessPasses`: ``bnrecal export``, the Python API, a one-worker run) or the
run's Ray ranks (:class:`RankPasses`, on the ``RankSet`` its executor gives); :func:`passes_on`
picks by the executor's ranks. Both give the same file and figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from bnrecal.workers.data import DatasetSpec, iter_batches
from bnrecal.workers.data.reading.alignment import positions_in
from bnrecal.workers.data.reading.kept import open_kept
from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.workers.ranks.ort.rank_pass import (
    Comparison, OnnxPassRequest, PassModel, onnx_pass, pass_phase,
)
from bnrecal.workers.ranks.plan import EvalPlan, GroupPass
from bnrecal.workers.ranks.sharding import rank_ranges

from bnrecal.service.export.int8.checks import LabelledBatches
from bnrecal.service.run.core import RankSet, RunControl

PassRecorder = Callable[[str, GroupPass], None]
"""Hears each pass as it ends, with the phase it served (``pass_phase``): the report's timeline."""

CALIBRATION, EVALUATION = "calibration", "evaluation"

T = TypeVar("T")


class OnnxPasses:
    """The passes of one INT8 export: over the calibration samples (``over_calibration``) or
    the evaluation data (``over_evaluation``), each one read of the samples (two for the
    histogram methods' ranges) combined in one collective per read; and the export's own
    computing between them (``map``: the quantizer, the entropy search, the checks), run
    where the passes run, so that a run on ranks leaves none of it to the job's host."""

    def __init__(self, labels: np.ndarray | None, evaluation_samples: int, shared: np.ndarray | None,
                 record: PassRecorder | None = None) -> None:
        self.labels = labels
        self.evaluation_samples = evaluation_samples
        self.shared = shared
        self.record = record
        self.work_seconds = 0.0

    @property
    def labelled(self) -> bool:
        """Whether there is labelled evaluation data to score models on."""
        return self.labels is not None

    @property
    def shares_samples(self) -> bool:
        """Whether the evaluation samples are the calibration samples: a pass over them does both."""
        return self.shared is not None

    def over_calibration(self, models: Sequence[PassModel], *, evaluate: bool = False,
                         compare: Comparison | None = None, output: int = 0) -> GroupPass:
        """One pass over the calibration samples, gathering each model's ranges; with
        ``evaluate`` (only where they are the evaluation samples) also scoring the models on
        their labels and measuring ``compare``."""
        labels = positions = None
        if evaluate:
            if self.shared is None:
                raise ValueError("the calibration samples are not the evaluation samples")
            positions = self.shared
            labels = self.labels[self.shared] if self.labels is not None else None
        request = OnnxPassRequest(tuple(models), labels, positions, compare if evaluate else None, "all", output)
        return self._recorded(request, CALIBRATION)

    def over_evaluation(self, models: Sequence[PassModel], *, compare: Comparison | None = None, part: str = "all",
                        output: int = 0) -> GroupPass:
        """One pass over ``part`` of the evaluation data: the models scored (when it is
        labelled) on each part, and ``compare`` measured. Where the evaluation samples are
        the calibration samples the pass reads those (what the ranks kept of them), each
        sample's label and part found by its evaluation position."""
        if self.shared is not None:
            labels = self.labels[self.shared] if self.labels is not None else None
            request = OnnxPassRequest(tuple(models), labels, self.shared, compare, part, output)
            return self._recorded(request, CALIBRATION)
        request = OnnxPassRequest(tuple(models), self.labels, None, compare, part, output)
        return self._recorded(request, EVALUATION)

    def map(self, work: Callable[..., T], calls: Sequence[tuple[Any, ...]]) -> list[T]:
        """``work(*args)`` for each ``args`` of ``calls``, where the passes run: here for a
        world of one, spread over the ranks for a run on Ray (``workers.ranks.offload``).
        ``work`` is a module's function and its arguments picklable; the results come in
        the order of ``calls``. Its seconds add to ``work_seconds`` (the report's timeline)."""
        started = time.monotonic()
        try:
            return self._map(work, calls)
        finally:
            self.work_seconds += time.monotonic() - started

    def _map(self, work: Callable[..., T], calls: Sequence[tuple[Any, ...]]) -> list[T]:
        """The calls, here, in order: a subclass on ranks spreads them."""
        return [work(*args) for args in calls]

    def call(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` where the passes run (one call of :meth:`map`)."""
        return self.map(work, [args])[0]

    def _recorded(self, request: OnnxPassRequest, over: str) -> GroupPass:
        done = self._run(request, over)
        if self.record is not None:
            self.record(pass_phase(request), done)
        return done

    def _run(self, request: OnnxPassRequest, over: str) -> GroupPass:
        """Run one pass over ``over`` (``CALIBRATION`` or ``EVALUATION``): the subclass's."""
        raise NotImplementedError


class InProcessPasses(OnnxPasses):
    """Passes in this process (a world of one): over the first ``samples`` (default: all) of
    ``calibration`` at global batch ``batch_size``, and over the evaluation data: a described
    one (an ``EvalPlan``) or batches held in memory (the Python API's)."""

    def __init__(self, calibration: DatasetSpec, batch_size: int, samples: int | None = None, *,
                 evaluation: EvalPlan | LabelledBatches | None = None, record: PassRecorder | None = None) -> None:
        self.calibration = calibration
        self.batch_size = batch_size
        self.samples = samples_read(calibration, samples)
        self.evaluation = evaluation
        if isinstance(evaluation, LabelledBatches):
            labels = np.concatenate(evaluation.labels) if evaluation.labels else np.zeros(0, dtype=np.int64)
            super().__init__(labels, evaluation.samples, None, record)
        else:
            super().__init__(*described_evaluation(calibration, self.samples, evaluation), record=record)

    def _run(self, request: OnnxPassRequest, over: str) -> GroupPass:
        collective = SingleProcessCollective()
        if over == EVALUATION and isinstance(self.evaluation, LabelledBatches):
            held = [np.asarray(batch, dtype=np.float32) for batch in self.evaluation.batches]
            starts = np.cumsum([0, *map(len, held)])
            ranges = [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
            result = onnx_pass(request, ranges, lambda: map(torch.from_numpy, held), collective, 0)
        else:
            if over == EVALUATION:
                assert isinstance(self.evaluation, EvalPlan)
                dataset, batch, total = self.evaluation.dataset, self.evaluation.batch_size, None
            else:
                dataset, batch, total = self.calibration, self.batch_size, self.samples
            ranges = rank_ranges(samples_read(dataset, total), batch, 1, 0)
            with open_kept(dataset, dataset.open()) as data:
                result = onnx_pass(request, ranges, lambda: iter_batches(data, ranges), collective, 0)
        return GroupPass(result, [result.samples], [result.collectives], ["in-process"], result.seconds)


class RankPasses(OnnxPasses):
    """Passes on a run's Ray ranks (``workers.ranks.ort.group``): over the first ``samples``
    of ``dataset`` by the calibration's sharding at ``batch_size``, and over the evaluation
    data by its own, placed and fed like the calibration's ranks (``ranks``). A lost rank
    re-runs that pass only, as ``control``'s policy (the run's) allows; its ``failures``
    collect why, ``on_phase`` shows it."""

    def __init__(
        self, ranks: RankSet, dataset: DatasetSpec, batch_size: int, samples: int | None, evaluation: EvalPlan | None,
        *, control: RunControl | None = None, on_phase: Callable[[str], None] | None = None,
        record: PassRecorder | None = None,
    ) -> None:
        self.ranks = ranks
        self.dataset, self.batch_size, self.samples = dataset, batch_size, samples_read(dataset, samples)
        self.evaluation = evaluation
        self.control, self.on_phase = control or RunControl(), on_phase
        super().__init__(*described_evaluation(dataset, self.samples, evaluation), record=record)

    def _run(self, request: OnnxPassRequest, over: str) -> GroupPass:
        """One pass on the ranks, retried as the policy allows."""
        from bnrecal.workers.ranks.ort.group import run_onnx_pass_group
        from bnrecal.workers.ranks.process.ray_collective import backend_for_device

        ranks = self.ranks
        if over == CALIBRATION:
            dataset, batch, shards, total = self.dataset, self.batch_size, ranks.shards, self.samples
        else:
            assert self.evaluation is not None
            dataset, batch, shards, total = self.evaluation.dataset, self.evaluation.batch_size, ranks.eval_shards, None
        phase = pass_phase(request)

        def attempt() -> GroupPass:
            self.control.check_cancel()
            return run_onnx_pass_group(
                request, dataset, batch, ranks.workers, ranks.device, backend_for_device(ranks.device), ranks.group,
                num_samples=total, shards=shards, pool=ranks.gang, cancel=self.control.cancel,
            )

        retried = (lambda why: self.on_phase(f"running the {phase} pass again after: {why}")) if self.on_phase else None
        return self.control.retried(attempt, retried)

    def _map(self, work: Callable[..., T], calls: Sequence[tuple[Any, ...]]) -> list[T]:
        """The calls in the ranks' processes, spread over them, retried as the policy allows."""
        return self.ranks.map(work, calls, control=self.control, on_phase=self.on_phase)


def passes_on(
    ranks: RankSet | None, dataset: DatasetSpec, batch_size: int, samples: int, evaluation: EvalPlan | None, *,
    control: RunControl, on_phase: Callable[[str], None] | None, record: PassRecorder | None,
) -> OnnxPasses:
    """A run's onnxruntime passes where its phases after the statistics run (its executor's
    ``ranks()``): on its Ray ranks, or here for a world of one; over the first ``samples`` of
    ``dataset`` with the calibration's sharding, and over the evaluation data, under ``control``."""
    if ranks is None:
        return InProcessPasses(dataset, batch_size, samples, evaluation=evaluation, record=record)
    return RankPasses(ranks, dataset, batch_size, samples, evaluation, control=control, on_phase=on_phase, record=record)


def described_evaluation(
    calibration: DatasetSpec, samples: int, evaluation: EvalPlan | None,
) -> tuple[np.ndarray | None, int, np.ndarray | None]:
    """What the passes know of described evaluation data: its labels (where accuracy is
    measured), its samples, and each calibration position's evaluation position where the
    first ``samples`` of the calibration order are exactly its samples."""
    if evaluation is None:
        return None, 0, None
    labels = evaluation.labels if evaluation.target.labelled else None
    return labels, evaluation.dataset.num_samples, positions_in(calibration, samples, evaluation.dataset)


def samples_read(dataset: DatasetSpec, samples: int | None) -> int:
    """How many samples of ``dataset`` (in its order) a pass reads."""
    return dataset.num_samples if samples is None else min(samples, dataset.num_samples)
