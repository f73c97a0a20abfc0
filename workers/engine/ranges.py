"""Activation ranges for INT8 quantization, and how ranks combine them (docs/int8.md, "How
the ranges are gathered").

Pure numpy and torch: no Ray, no onnxruntime session. A rank adds every batch's values
of each calibrated tensor to a :class:`MinMaxAccumulator` (pass 1) and, for the
histogram methods, to a :class:`HistogramAccumulator` over the range pass 1 agreed on
(pass 2). Each pass ends in ONE collective through the engine's SUM ``Collective``:

- min/max: every rank writes its ``[min, max]`` per tensor into its own slot of a
  ``[world, 2, tensors]`` float64 buffer, zeros elsewhere; the SUM allreduce is then an
  all-gather (adding exact zeros to a float is exact, ``inf + 0 = inf``) and every rank takes the
  min and max over the slots. This keeps the collective a SUM (the only reduction the
  ``Collective`` interface, GLOO and NCCL share here), costs K small buffers, and the
  result is exactly the min and max of all values, whatever K;
- histograms: counts per bin of every tensor in one float64 buffer, summed (integer
  counts below 2**53 are exact in float64). Bin edges come from the shared range, so a
  value lands in the same bin whichever rank saw it: the sum does not depend on K.

The values are float32 as onnxruntime computes them; min and max are kept in float32,
as onnxruntime's ``MinMaxCalibrater`` keeps them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bnrecal.workers.engine.collective import Collective

HISTOGRAM_METHODS = ("percentile", "entropy")


@dataclass(frozen=True)
class TensorRanges:
    """The min and max (float32) of every calibrated tensor, in ``names`` order."""

    names: tuple[str, ...]
    low: np.ndarray
    high: np.ndarray

    def pairs(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """name -> (min, max) as 1-element float32 arrays, the form onnxruntime's
        ``MinMaxCalibrater`` hands its quantizer."""
        return {
            name: (np.array([self.low[i]], dtype=np.float32), np.array([self.high[i]], dtype=np.float32))
            for i, name in enumerate(self.names)
        }


class MinMaxAccumulator:
    """One rank's running min and max of each tensor (NaNs ignored, as onnxruntime does)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.low = np.full(len(self.names), np.inf, dtype=np.float32)
        self.high = np.full(len(self.names), -np.inf, dtype=np.float32)
        self.batches = 0

    def add(self, index: int, values: np.ndarray) -> None:
        """Fold one batch's values of tensor ``index`` in: one read of them (``torch.aminmax``),
        a second only where a NaN is among them."""
        if values.size == 0:
            return
        low, high = (float(v) for v in torch.aminmax(torch.from_numpy(np.ascontiguousarray(values)).reshape(-1)))
        if np.isnan(low) or np.isnan(high):
            finite = values[~np.isnan(values)]
            if finite.size == 0:
                return
            low, high = float(finite.min()), float(finite.max())
        self.low[index] = min(self.low[index], np.float32(low))
        self.high[index] = max(self.high[index], np.float32(high))

    def slots(self, world_size: int, rank: int) -> torch.Tensor:
        """This rank's ``[world, 2, tensors]`` float64 buffer: its min and max in its own slot,
        zeros elsewhere; summed over the ranks it holds every rank's (``from_slots``)."""
        buffer = torch.zeros((world_size, 2, len(self.names)), dtype=torch.float64)
        buffer[rank, 0] = torch.from_numpy(self.low.astype(np.float64))
        buffer[rank, 1] = torch.from_numpy(self.high.astype(np.float64))
        return buffer

    def from_slots(self, summed: torch.Tensor) -> TensorRanges:
        """The min and max over every rank, from the summed ``slots`` buffers."""
        low = summed[:, 0].min(dim=0).values.numpy().astype(np.float32)
        high = summed[:, 1].max(dim=0).values.numpy().astype(np.float32)
        return TensorRanges(self.names, low, high)

    def combine(self, collective: Collective, rank: int) -> TensorRanges:
        """The min and max over every rank, in one SUM allreduce of one-hot slots."""
        buffer = self.slots(collective.world_size, rank)
        collective.allreduce(buffer)
        return self.from_slots(buffer)


def histogram_range(low: np.float32, high: np.float32, absolute: bool) -> tuple[np.float32, np.float32]:
    """The range a tensor's histogram covers: ``[0, max|x|]`` for a histogram of absolute
    values (onnxruntime's symmetric percentile), else ``[-max|x|, max|x|]`` (its
    entropy and asymmetric percentile histograms are centred on zero)."""
    threshold = np.float32(max(abs(float(low)), abs(float(high))))
    return (np.float32(0.0), threshold) if absolute else (np.float32(-threshold), threshold)


class HistogramAccumulator:
    """One rank's histogram of each tensor, ``bins`` bins over the shared range."""

    def __init__(self, ranges: TensorRanges, bins: int, absolute: bool) -> None:
        self.names = ranges.names
        self.bins = bins
        self.absolute = absolute
        self.ranges = [histogram_range(lo, hi, absolute) for lo, hi in zip(ranges.low, ranges.high)]
        self.counts = np.zeros((len(self.names), bins), dtype=np.float64)

    def edges(self, index: int) -> np.ndarray:
        """The bin edges of tensor ``index`` (float32, as numpy makes them for float32 data)."""
        _, edges = np.histogram(np.zeros(0, dtype=np.float32), bins=self.bins, range=self.ranges[index])
        return edges

    def add(self, index: int, values: np.ndarray) -> None:
        """Count one batch's values of tensor ``index``."""
        if values.size == 0:
            return
        data = np.abs(values.ravel()) if self.absolute else values.ravel()
        counts, _ = np.histogram(data, bins=self.bins, range=self.ranges[index])
        self.counts[index] += counts

    def combine(self, collective: Collective) -> np.ndarray:
        """Every rank's counts summed, in one SUM allreduce; returns int64 counts."""
        buffer = torch.from_numpy(self.counts.copy())
        collective.allreduce(buffer)
        return buffer.numpy().astype(np.int64)


def fixed_batch(session: Any) -> int | None:
    """The batch size a model's input is fixed at (a program exported with a static batch), or None."""
    size = session.get_inputs()[0].shape[0]
    return size if isinstance(size, int) and size > 0 else None


def in_batches_of(array: np.ndarray, size: int | None) -> Iterable[np.ndarray]:
    """``array`` as it can be fed: whole, or in parts of a model's fixed batch size (a part
    that does not fill that batch cannot run: an error says so)."""
    if len(array) == 0:
        return
    if size is None:
        yield array
        return
    if len(array) % size:
        raise ValueError(
            f"the model takes a fixed batch of {size} and a rank's slice has {len(array)} samples: "
            f"choose batch_size and workers so that every slice is a multiple of {size}"
        )
    for start in range(0, len(array), size):
        yield array[start : start + size]
