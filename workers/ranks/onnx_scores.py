"""One rank's share of scoring exported models: top-1 and top-5 of each ONNX model
(onnxruntime, as deployed) over the rank's shard of the labelled evaluation data, every
model on each batch as it is read, the counts combined with the peers' in one SUM
collective (docs/int8.md, "Checks and the report's `int8` section").

The shard is the evaluation's sharding (``workers.ranks.sharding``), so the figures are
the same for any number of ranks. A part of the samples may be scored alone, by position:
the INT8 guard chooses its float ops on the even positions and reports on the odd ones.
The same function runs in a rank actor and in a plain process (the world of one).
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
from bnrecal.workers.engine.ranges import fixed_batch, in_batches_of

PARTS = ("all", "even", "odd")
"""Which evaluation samples are scored, by their position in the evaluation data."""


@dataclass(frozen=True)
class ScoreRequest:
    """What to score on: the labels of the evaluation samples (by position), and which of
    them (``PARTS``)."""

    labels: np.ndarray
    part: str = "all"

    def __post_init__(self) -> None:
        if self.part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {self.part!r}")


@dataclass
class ScoreResult:
    """Correct answers of each model and the samples scored (both summed over the ranks),
    and this rank's samples read, collectives and seconds."""

    top1: list[int]
    top5: list[int]
    scored: int
    samples: int
    collectives: int
    seconds: float

    def scores(self, index: int) -> dict[str, float]:
        """Model ``index``'s top-1 and top-5 as fractions, with the samples they are over."""
        total = max(1, self.scored)
        return {"top1": self.top1[index] / total, "top5": self.top5[index] / total, "samples": self.scored}


def correct_answers(scores: np.ndarray, labels: np.ndarray) -> tuple[int, int]:
    """How many rows of class ``scores`` rank their label first, and within the first five
    (ties ranked by class index, as a stable sort does)."""
    ranked = np.argsort(-scores.reshape(len(scores), -1), axis=1, kind="stable")[:, :5]
    return int(np.sum(ranked[:, 0] == labels)), int(np.sum(np.any(ranked == labels[:, None], axis=1)))


def scoring_session(model: bytes, threads: int) -> Any:
    """An onnxruntime CPU session with the default (full) graph optimizations, as a deployment
    runs the file: where QuantizeLinear/DequantizeLinear pairs become INT8 kernels."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    options.log_severity_level = 3
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def score_pass(
    models: Sequence[bytes],
    request: ScoreRequest,
    ranges: Sequence[tuple[int, int]],
    batches: Iterable[torch.Tensor],
    collective: Collective,
    *,
    threads: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> ScoreResult:
    """Score every model on this rank's ``batches`` (one per ``ranges`` entry, the positions
    of its samples), keeping the samples of ``request.part``; one collective sums the counts
    of every rank. ``on_batch`` hears the samples of every batch read."""
    started = time.perf_counter()
    sessions = [scoring_session(model, threads or min(4, os.cpu_count() or 1)) for model in models]
    counts = np.zeros(2 * len(models) + 1, dtype=np.float64)  # top-1 per model, top-5 per model, samples
    calls_before = collective.calls
    read = 0
    for (start, stop), batch in zip(ranges, batches, strict=True):
        positions = np.arange(start, stop)
        keep = positions % 2 == (0 if request.part == "even" else 1) if request.part != "all" else slice(None)
        array = batch.detach().cpu().numpy().astype(np.float32, copy=False)[keep]
        labels = np.asarray(request.labels[positions][keep], dtype=np.int64)
        for index, session in enumerate(sessions):
            name, fixed = session.get_inputs()[0].name, fixed_batch(session)
            if len(array):
                parts = [session.run(None, {name: part})[0] for part in in_batches_of(array, fixed)]
                top1, top5 = correct_answers(np.concatenate(parts), labels)
                counts[index] += top1
                counts[len(models) + index] += top5
        counts[-1] += len(array)
        read += stop - start
        if on_batch is not None:
            on_batch(stop - start)
    buffer = torch.from_numpy(counts)
    collective.allreduce(buffer)
    total = buffer.numpy()
    return ScoreResult(
        top1=[int(round(v)) for v in total[: len(models)]], top5=[int(round(v)) for v in total[len(models): -1]],
        scored=int(round(total[-1])), samples=read, collectives=collective.calls - calls_before,
        seconds=time.perf_counter() - started,
    )
