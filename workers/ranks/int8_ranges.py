"""One rank's share of the INT8 range collection: the folded FP32 model in onnxruntime
over the rank's shard, each calibrated tensor's values gathered, combined across ranks
in one collective per pass (the math is ``workers.engine.ranges``).

onnxruntime runs as its own calibrators run it (graph optimizations off), with the
calibrated tensors added as graph outputs, so every value is the one onnxruntime's
``MinMaxCalibrater`` would reduce. The same function runs in a rank actor (a
``RayCollective``) and in a plain process (the world of one: ``bnrecal export``, the
Python API).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bnrecal.workers.engine.collective import Collective
from bnrecal.workers.engine.ranges import HistogramAccumulator, MinMaxAccumulator, TensorRanges, fixed_batch, in_batches_of


@dataclass(frozen=True)
class RangeRequest:
    """What to gather: the tensors (graph value names) and, for the histogram methods,
    the bins and whether to histogram absolute values (onnxruntime's symmetric percentile)."""

    tensors: tuple[str, ...]
    method: str = "minmax"
    bins: int = 2048
    absolute: bool = False


@dataclass
class RangeResult:
    """Combined ranges (every rank holds the same), histograms for the histogram methods,
    and this rank's counts."""

    ranges: TensorRanges
    histograms: np.ndarray | None
    edges: list[np.ndarray] | None
    samples: int
    collectives: int
    seconds: float


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


def range_pass(
    model_bytes: bytes,
    request: RangeRequest,
    batches: Callable[[], Iterable[torch.Tensor]],
    collective: Collective,
    rank: int,
    *,
    threads: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> RangeResult:
    """Gather the ranges of ``request.tensors`` over this rank's batches, combined with its
    peers': one collective for min/max, and for percentile/entropy one more for the
    histograms over the shared range (``batches`` is called once per pass). ``on_batch``
    hears the samples of every batch run, so a driver can tell progress from a hang."""
    started = time.perf_counter()
    session = calibration_session(with_outputs(model_bytes, request.tensors), threads or (os.cpu_count() or 1))
    input_name = session.get_inputs()[0].name
    names = list(request.tensors)
    calls_before = collective.calls
    fixed = fixed_batch(session)
    counted = [0]

    def values() -> Iterable[list[np.ndarray]]:
        counted[0] = 0
        for batch in batches():
            array = batch.detach().cpu().numpy().astype(np.float32, copy=False)
            counted[0] += len(array)
            for part in in_batches_of(array, fixed):
                yield session.run(names, {input_name: part})
            if on_batch is not None:
                on_batch(len(array))

    minmax = MinMaxAccumulator(names)
    for outputs in values():
        for index, value in enumerate(outputs):
            minmax.add(index, np.asarray(value))
    samples = counted[0]
    ranges = minmax.combine(collective, rank)
    histograms = edges = None
    if request.method in ("percentile", "entropy"):
        accumulator = HistogramAccumulator(ranges, request.bins, request.absolute)
        for outputs in values():
            for index, value in enumerate(outputs):
                accumulator.add(index, np.asarray(value))
        histograms = accumulator.combine(collective)
        edges = [accumulator.edges(i) for i in range(len(names))]
    return RangeResult(
        ranges, histograms, edges, samples, collective.calls - calls_before, time.perf_counter() - started
    )
