"""One rank's onnxruntime pass over its shard: every ONNX model of the pass on each batch as
it is read, for whatever the pass was asked (docs/int8.md, "How the ranges are gathered"):

- the INT8 activation ranges of a model: each calibrated tensor's min and max, and for the
  histogram methods (``percentile``, ``entropy``) its histogram over the range every rank
  agreed on, in a second read of the same samples (the math is ``workers.engine.ranges``);
- top-1 and top-5 of models on labelled samples: on all of them and on the INT8 guard's two
  parts (the samples at even and at odd evaluation positions), in the same read;
- the evaluation before and after recalibration between two of its models, the stale and
  the recalibrated one (``workers.engine.evaluation.EvalTotals``: top-1/top-5,
  cross-entropy, changed predictions, KL).

So the passes of a job that run models over the same samples are one pass: the two FP32
models' ranges, their evaluation and their scores in one read, then the INT8 models'
scores in another. Everything a read adds up is combined with the peers' in ONE SUM
collective (min/max in one-hot rank slots, counts and sums added), so the figures are the
same for any number of ranks.

A model whose ranges are gathered runs as onnxruntime's own calibrators run it (graph
optimizations off), the calibrated tensors added as graph outputs, so every value is the
one onnxruntime's ``MinMaxCalibrater`` would reduce; a model only scored runs as a
deployment runs it (full graph optimizations, where Q/DQ pairs become INT8 kernels). The
same function runs in a rank actor (a ``RayCollective``) and in a plain process (the world
of one: ``bnrecal export``, the Python API, a one-worker run).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bnrecal.workers.engine.collective import Collective
from bnrecal.workers.engine.evaluation import EvalMetrics, EvalTarget, EvalTotals
from bnrecal.workers.engine.ranges import (
    HISTOGRAM_METHODS, HistogramAccumulator, MinMaxAccumulator, TensorRanges, fixed_batch,
)
from bnrecal.workers.ranks.ort.pieces import PieceRunner

PARTS = ("all", "even", "odd")
"""Which labelled samples a score is over, by their position in the evaluation data: all,
the guard's selection part (even positions) and its report part (odd positions)."""


@dataclass(frozen=True)
class RangeRequest:
    """What to gather of a model: the tensors (graph value names) and, for the histogram
    methods, the bins and whether to histogram absolute values (onnxruntime's symmetric
    percentile)."""

    tensors: tuple[str, ...]
    method: str = "minmax"
    bins: int = 2048
    absolute: bool = False


@dataclass(frozen=True)
class PassModel:
    """One ONNX model (serialized) of a pass, and the ranges to gather of it, if any."""

    model: bytes
    ranges: RangeRequest | None = None


@dataclass(frozen=True)
class Comparison:
    """The evaluation before and after: the pass's models with the uploaded statistics
    (``before``) and the recalibrated ones (``after``), by index, and what to measure."""

    before: int
    after: int
    target: EvalTarget


@dataclass(frozen=True)
class OnnxPassRequest:
    """A pass: its models, and what to add up besides their ranges. ``labels`` holds the
    label of each sample position the pass reads (every model is then scored on each part);
    ``positions`` each read position's position in the evaluation data (its part), when the
    pass reads the evaluation samples in another order (the calibration order); ``part``
    which samples the models run on (``PARTS``: a pass scoring the guard's selection part
    runs half the samples); ``output`` is the graph output holding the class scores."""

    models: tuple[PassModel, ...]
    labels: np.ndarray | None = None
    positions: np.ndarray | None = None
    compare: Comparison | None = None
    part: str = "all"
    output: int = 0

    def __post_init__(self) -> None:
        if self.part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {self.part!r}")
        if self.part != "all" and (self.compare is not None or any(m.ranges is not None for m in self.models)):
            raise ValueError("ranges and the comparison are gathered over every sample (part 'all')")

    @property
    def reads_outputs(self) -> bool:
        """Whether the pass looks at the models' class scores (to score or compare them)."""
        return self.labels is not None or self.compare is not None


@dataclass
class ModelResult:
    """What a pass found of one model: its ranges (and histograms with their bin edges),
    and its right answers on each part (``PARTS``), top-1 and top-5, summed over the ranks."""

    ranges: TensorRanges | None = None
    histograms: np.ndarray | None = None
    edges: list[np.ndarray] | None = None
    top1: tuple[int, ...] = ()
    top5: tuple[int, ...] = ()


@dataclass
class OnnxPassResult:
    """A pass's results (every rank holds the same), with this rank's own counts: samples
    read, collectives made, seconds."""

    models: list[ModelResult]
    scored: tuple[int, ...] = ()
    evaluation: EvalMetrics | None = None
    samples: int = 0
    collectives: int = 0
    seconds: float = 0.0

    part: str = "all"

    def scores(self, index: int, part: str = "all") -> dict[str, float]:
        """Model ``index``'s top-1 and top-5 on ``part`` as fractions, with the samples they are over."""
        if self.part not in ("all", part):
            raise ValueError(f"a pass over the {self.part} part has no scores on {part!r}")
        at = PARTS.index(part)
        result = self.models[index]
        total = self.scored[at]
        return {"top1": result.top1[at] / max(1, total), "top5": result.top5[at] / max(1, total), "samples": total}


def pass_phase(request: OnnxPassRequest) -> str:
    """What a pass does, as the report's timeline and messages name it (docs/report.md)."""
    ranges = any(model.ranges is not None for model in request.models)
    if ranges and request.compare is not None:
        return "INT8 ranges and evaluation before and after"
    if ranges:
        return "INT8 ranges"
    if request.compare is not None:
        return "evaluation before and after"
    return "INT8 evaluations"


def with_outputs(model_bytes: bytes, tensors: Sequence[str]) -> bytes:
    """The model with ``tensors`` added as graph outputs (their value infos as found)."""
    import onnx

    model = onnx.load_from_string(model_bytes)
    infos = {vi.name: vi for vi in (*model.graph.value_info, *model.graph.input, *model.graph.output)}
    present = {out.name for out in model.graph.output}
    for name in tensors:
        if name not in present:
            model.graph.output.append(infos[name])
    return model.SerializeToString()


def calibration_session(model_bytes: bytes, threads: int) -> Any:
    """An onnxruntime CPU session as onnxruntime's calibrators make theirs (no graph optimization)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = max(1, threads)
    options.log_severity_level = 3
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def scoring_session(model: bytes, threads: int) -> Any:
    """An onnxruntime CPU session with the default (full) graph optimizations, as a deployment
    runs the file: where QuantizeLinear/DequantizeLinear pairs become INT8 kernels."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    options.log_severity_level = 3
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def correct_answers(scores: np.ndarray, labels: np.ndarray) -> tuple[int, int]:
    """How many rows of class ``scores`` rank their label first, and within the first five
    (ties ranked by class index, as a stable sort does)."""
    if len(scores) == 0:
        return 0, 0
    ranked = np.argsort(-scores.reshape(len(scores), -1), axis=1, kind="stable")[:, :5]
    return int(np.sum(ranked[:, 0] == labels)), int(np.sum(np.any(ranked == labels[:, None], axis=1)))


@dataclass
class _Runner:
    """One model's session and the outputs a pass reads of it."""

    session: Any
    names: list[str]
    scores_at: int | None
    ranges: MinMaxAccumulator | None
    fixed: int | None = None
    right: np.ndarray = field(default_factory=lambda: np.zeros((2, len(PARTS)), dtype=np.float64))
    _runs: dict[tuple[str, ...], PieceRunner] = field(default_factory=dict)

    def pieces(self, array: np.ndarray, names: Sequence[str] | None = None) -> Iterator[list[np.ndarray]]:
        """The named outputs on ``array``, run in pieces (``workers.ranks.ort.pieces``);
        each piece's arrays are valid until the next piece runs."""
        wanted = tuple(names if names is not None else self.names)
        if wanted not in self._runs:
            self._runs[wanted] = PieceRunner(self.session, wanted, self.fixed)
        return self._runs[wanted].pieces(array)

    def read(self, array: np.ndarray) -> np.ndarray | None:
        """Run the model on ``array``: its calibrated tensors' ranges added up, its class
        scores returned (None where the pass does not read them)."""
        scores = []
        for outputs in self.pieces(array):
            if self.ranges is not None:
                for index in range(len(self.ranges.names)):
                    self.ranges.add(index, outputs[index])
            if self.scores_at is not None:
                scores.append(outputs[self.scores_at].copy())  # the buffer is the next piece's
        return np.concatenate(scores) if scores else None


def _runner(model: PassModel, request: OnnxPassRequest, threads: int) -> _Runner:
    """``model``'s session (as onnxruntime's calibrators run it where its ranges are gathered,
    else as deployed) and the outputs to read: the calibrated tensors, then the class scores."""
    if model.ranges is None:
        session = scoring_session(model.model, threads)
        gathered: tuple[str, ...] = ()
    else:
        gathered = tuple(dict.fromkeys(model.ranges.tensors))
        session = calibration_session(with_outputs(model.model, gathered), threads)
    names = list(gathered)
    scores_at = None
    if request.reads_outputs:
        output = session.get_outputs()[request.output].name
        if output not in names:
            names.append(output)
        scores_at = names.index(output)
    return _Runner(session, names, scores_at, MinMaxAccumulator(gathered) if model.ranges else None,
                   fixed_batch(session))


def onnx_pass(
    request: OnnxPassRequest,
    ranges: Sequence[tuple[int, int]],
    batches: Callable[[], Iterable[torch.Tensor]],
    collective: Collective,
    rank: int,
    *,
    threads: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> OnnxPassResult:
    """Run every model of ``request`` on this rank's batches (one per ``ranges`` entry, the
    positions of its samples; ``batches`` is called once per read), then combine with the
    peers: one collective for the first read (ranges, scores, the comparison), one more for
    the histograms of the histogram methods, read again. ``on_batch`` hears the samples of
    every batch read, so a driver can tell progress from a hang."""
    started = time.perf_counter()
    runners = [_runner(model, request, threads or min(4, os.cpu_count() or 1)) for model in request.models]
    calls_before = collective.calls
    scored = np.zeros(len(PARTS), dtype=np.float64)
    totals = EvalTotals() if request.compare is not None else None
    read = 0
    for (start, stop), batch in zip(ranges, batches(), strict=True):
        array = batch.detach().cpu().numpy().astype(np.float32, copy=False)
        parts = _part_masks(request, start, stop)
        run = parts[PARTS.index(request.part)]
        if request.part != "all":  # only the samples of that part run
            array, parts = array[run], [mask[run] for mask in parts]
        if len(array):
            scores = [runner.read(array) for runner in runners]
            if request.labels is not None:
                labels = np.asarray(request.labels[start:stop], dtype=np.int64)[run]
                scored += [mask.sum() for mask in parts]
                for runner, values in zip(runners, scores):
                    for at, mask in enumerate(parts):
                        top1, top5 = correct_answers(values[mask], labels[mask])
                        runner.right[:, at] += (top1, top5)
            if totals is not None and request.compare is not None:
                compare = request.compare
                before, after = scores[compare.before], scores[compare.after]
                labelled = compare.target.labelled and request.labels is not None
                y = torch.from_numpy(labels) if labelled else None
                totals.add(torch.from_numpy(before), torch.from_numpy(after), y)
        read += stop - start
        if on_batch is not None:
            on_batch(stop - start)
    results = _combine_first_read(runners, scored, totals, collective, rank)
    evaluation = totals.summary(request.compare.target) if totals is not None and request.compare else None
    _histograms(request, runners, results, ranges, batches, collective, on_batch)
    return OnnxPassResult(
        models=results, scored=tuple(int(round(v)) for v in scored) if request.labels is not None else (),
        evaluation=evaluation, samples=read, collectives=collective.calls - calls_before,
        seconds=time.perf_counter() - started, part=request.part,
    )


def _part_masks(request: OnnxPassRequest, start: int, stop: int) -> list[np.ndarray]:
    """Which samples of positions ``[start, stop)`` fall in each part (``PARTS``)."""
    positions = np.arange(start, stop) if request.positions is None else np.asarray(request.positions[start:stop])
    even = positions % 2 == 0
    return [np.ones(len(positions), dtype=bool), even, ~even]


def _combine_first_read(
    runners: list[_Runner], scored: np.ndarray, totals: EvalTotals | None, collective: Collective, rank: int,
) -> list[ModelResult]:
    """Every rank's ranges, right answers, scored samples and evaluation sums, in ONE SUM
    allreduce (min/max as one-hot rank slots, the rest added); ``scored`` and ``totals``
    are replaced by the sums."""
    parts = [runner.ranges.slots(collective.world_size, rank) for runner in runners if runner.ranges is not None]
    parts += [torch.from_numpy(runner.right.copy()) for runner in runners]
    parts.append(torch.from_numpy(scored.copy()))
    if totals is not None:
        parts.append(totals.values)
    flat = torch.cat([part.reshape(-1) for part in parts])
    collective.allreduce(flat)
    summed = iter(torch.split(flat, [part.numel() for part in parts]))
    results: list[ModelResult] = []
    for runner in runners:
        ranges = runner.ranges.from_slots(next(summed).reshape(collective.world_size, 2, -1)) if runner.ranges else None
        results.append(ModelResult(ranges=ranges))
    for runner, result in zip(runners, results):
        right = next(summed).reshape(2, len(PARTS)).numpy()
        result.top1, result.top5 = (tuple(int(round(v)) for v in row) for row in right)
    scored[:] = next(summed).numpy()
    if totals is not None:
        totals.values = next(summed).clone()
    return results


def _histograms(
    request: OnnxPassRequest, runners: list[_Runner], results: list[ModelResult], ranges: Sequence[tuple[int, int]],
    batches: Callable[[], Iterable[torch.Tensor]], collective: Collective, on_batch: Callable[[int], None] | None,
) -> None:
    """The histogram methods' second read: each such model's calibrated tensors binned over
    the range the first read agreed on, every rank's counts summed in one collective."""
    wanted = [
        (runner, result, HistogramAccumulator(result.ranges, model.ranges.bins, model.ranges.absolute))
        for model, runner, result in zip(request.models, runners, results)
        if model.ranges is not None and model.ranges.method in HISTOGRAM_METHODS and result.ranges is not None
    ]
    if not wanted:
        return
    for (_, _), batch in zip(ranges, batches(), strict=True):
        array = batch.detach().cpu().numpy().astype(np.float32, copy=False)
        for runner, _, histogram in wanted:
            for outputs in runner.pieces(array, histogram.names):
                for index, values in enumerate(outputs):
                    histogram.add(index, values)
        if on_batch is not None:
            on_batch(len(array))
    counts = torch.from_numpy(np.concatenate([histogram.counts.reshape(-1) for _, _, histogram in wanted]))
    collective.allreduce(counts)
    summed = torch.split(counts, [histogram.counts.size for _, _, histogram in wanted])
    for (_, result, histogram), total in zip(wanted, summed):
        result.histograms = total.reshape(histogram.counts.shape).numpy().astype(np.int64)
        result.edges = [histogram.edges(i) for i in range(len(histogram.names))]
