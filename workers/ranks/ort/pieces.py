"""How a rank runs one onnxruntime session over its slice of a pass: in pieces of about
``RUN_BYTES`` of outputs, written into the same buffers run after run (docs/int8.md, "How
the ranges are gathered").

A model whose ranges are gathered returns every calibrated tensor (resnet18 at 224: 24 MB a
sample). Returned the plain way, each run's outputs land in fresh memory, and touching fresh
memory costs this kind of machine as much as the forward (page faults). So a slice runs in
pieces, each reduced by the caller before the next, and where the graph declares every
output's shape the outputs are bound (onnxruntime's I/O binding) to buffers allocated once
per piece size: the kernels write into them, the values are the ones a plain run returns.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from bnrecal.workers.engine.ranges import in_batches_of

RUN_BYTES = 128 * 2**20
"""The most output bytes one onnxruntime run of a pass should return: a rank's slice runs in
pieces of about that many bytes of outputs, each reduced before the next runs."""

FLOAT = "tensor(float)"


def samples_per_run(session: Any, names: Sequence[str]) -> int | None:
    """How many samples' outputs ``names`` fit ``RUN_BYTES``, from the shapes the graph
    declares (None where a shape beyond the batch is not known: the slice runs whole)."""
    dims = _sample_dims(session, names)
    if dims is None:
        return None
    per_sample = sum(4 * math.prod(shape) for shape in dims)  # float32, the calibrated tensors' type (an upper bound)
    return max(1, RUN_BYTES // max(1, per_sample))


def piece_sizes(count: int, most: int | None) -> list[int]:
    """``count`` samples in pieces of at most ``most`` (about), as even as can be and never of
    one sample where the slice has more: onnxruntime's Gemm runs one row another way than
    several (a matrix-vector kernel), and a sample's values must not depend on its piece."""
    if most is None or count <= most:
        return [count] if count else []
    pieces = min(-(-count // most), count // 2)
    return [len(part) for part in np.array_split(np.arange(count), pieces)]


def _sample_dims(session: Any, names: Sequence[str]) -> list[tuple[int, ...]] | None:
    """Each named output's shape past the batch axis as the session reports it (the graph's
    declaration merged with onnxruntime's own inference: a dimension they disagree on is
    reported unknown), None where one is unknown."""
    declared = {output.name: output.shape for output in session.get_outputs()}
    dims = [tuple(declared[name][1:]) for name in names]
    if not all(isinstance(dim, int) for shape in dims for dim in shape):
        return None
    return dims  # type: ignore[return-value]


class PieceRunner:
    """One session's named outputs over arrays of samples, run in pieces (``piece_sizes``),
    into buffers reused from run to run where the graph declares every output as float32 of a
    known shape. The arrays yielded for a piece are valid until the next piece runs: a caller
    that keeps one copies it."""

    def __init__(self, session: Any, names: Sequence[str], fixed: int | None = None) -> None:
        self.session = session
        self.names = list(names)
        self.fixed = fixed
        self.feed = session.get_inputs()[0].name
        types = {output.name: output.type for output in session.get_outputs()}
        dims = _sample_dims(session, self.names)
        self._dims = dims if dims is not None and all(types[n] == FLOAT for n in self.names) else None
        self._per_run = samples_per_run(session, self.names)  # once: the shapes do not change from batch to batch
        self._bound: dict[int, tuple[Any, list[np.ndarray]]] = {}

    def pieces(self, array: np.ndarray) -> Iterator[list[np.ndarray]]:
        """The outputs on ``array``, piece by piece: of the model's fixed batch, else of about
        ``RUN_BYTES`` of outputs."""
        if not self.names or not len(array):
            return
        if self.fixed is not None:
            parts: Iterator[np.ndarray] | list[np.ndarray] = iter(in_batches_of(array, self.fixed))
        else:
            sizes = piece_sizes(len(array), self._per_run)
            parts = np.split(array, np.cumsum(sizes)[:-1])
        for part in parts:
            yield self._run(np.ascontiguousarray(part))

    def _run(self, part: np.ndarray) -> list[np.ndarray]:
        """One run on ``part``: into the piece size's bound buffers where they can be had."""
        if self._dims is None or part.dtype != np.float32:
            return self.session.run(self.names, {self.feed: part})
        binding, buffers = self._binding(len(part))
        binding.bind_cpu_input(self.feed, part)
        self.session.run_with_iobinding(binding)
        # An output that is the input itself is not written to its buffer: it is the feed.
        return [part if name == self.feed else buffer for name, buffer in zip(self.names, buffers)]

    def _binding(self, size: int) -> tuple[Any, list[np.ndarray]]:
        """The I/O binding of a piece of ``size`` samples and its output buffers, made once
        (the last two sizes kept: a slice's pieces come in at most two)."""
        if size not in self._bound:
            assert self._dims is not None
            if len(self._bound) >= 2:
                del self._bound[next(iter(self._bound))]
            buffers = [np.empty((size, *shape), dtype=np.float32) for shape in self._dims]
            binding = self.session.io_binding()
            for name, buffer in zip(self.names, buffers):
                binding.bind_output(name, "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)
            self._bound[size] = (binding, buffers)
        return self._bound[size]
