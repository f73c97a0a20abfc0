"""One exporter trace for models that differ only in their weights: the stale model beside
the recalibrated one (docs/onnx.md, "The file"), and a sweep's cells of one architecture
(docs/onnx.md, "One trace for a sweep").

Tracing a model through torch's dynamo exporter is most of an export's time, and the stale
model (the checkpoint as uploaded, exported to measure what recalibrating bought) has the
recalibrated model's structure exactly: only BN statistics differ, and folds depend on the
structure, not the statistics; a sweep's pruned or averaged checkpoints of one architecture
differ in their weights only. So an export keeps its graph as the exporter wrote it
(before the graph passes) with the weights it was traced with, and the next export of a
model of the same structure puts that model's weights into it instead of tracing again.

The dynamo exporter makes every parameter and buffer an initializer named by its module
path, so a weight is found by name. A graph is reused only where that holds for the new
model: the same fold in PyTorch, the same export settings, each of its weights an
initializer of the same shape and dtype, or equal to the traced one. Anything else traces
anew. The result is then verified against the new model's own PyTorch outputs, as every
export is.

Since the trace depends on the structure only, a run can make it before its statistics are
in (``TraceAhead``, docs/onnx.md, "Where the export runs"): on a thread of the run's host
while its ranks start, when a core is free, and hand it to the ranks that export.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import onnx_ir as ir

logger = logging.getLogger(__name__)


@dataclass
class TracedGraph:
    """An exporter's graph before the graph passes (serialized), what it was traced with
    (``key``: export settings, sample shape, the PyTorch fold), and the traced model's weights."""

    raw: bytes
    exporter: str
    key: tuple[Any, ...]
    weights: dict[str, torch.Tensor]

    def with_weights(self, model: torch.nn.Module, key: tuple[Any, ...]) -> ir.Model | None:
        """This graph with ``model``'s weights in it, or None where ``model`` is not the
        traced structure (then it must be traced)."""
        import onnx
        import onnx_ir as ir

        if key != self.key or self.exporter != "dynamo":
            return None
        weights = model_weights(model)
        if weights.keys() != self.weights.keys():
            return None
        graph = ir.serde.deserialize_model(onnx.load_from_string(self.raw))
        initializers = graph.graph.initializers
        for name, tensor in weights.items():
            traced = self.weights[name]
            if tensor.shape != traced.shape or tensor.dtype != traced.dtype:
                return None
            if name not in initializers:
                if not torch.equal(tensor, traced):
                    return None  # a weight that differs and is not an initializer: not found by name
                continue
            initializers[name].const_value = ir.tensor(tensor.detach().cpu().numpy(), name=name)
        return graph


class GraphReuse:
    """Keeps the latest traced graph for the next export of the same structure (within one
    run: the stale model after the recalibrated one; within a sweep's scope on a rank, its
    next cell: ``workers.ranks.process.scoped``)."""

    def __init__(self, traced: TracedGraph | None = None) -> None:
        self.traced = traced

    def keep(self, graph: ir.Model, exporter: str, key: tuple[Any, ...], model: torch.nn.Module) -> None:
        """Keep ``graph`` (before the graph passes, which change it in place) as traced from
        ``model``, in place of the one kept before (a model of another structure: the models
        after it are more likely of its structure than of the older one's)."""
        import onnx_ir as ir

        raw = ir.serde.serialize_model(graph).SerializeToString()
        self.traced = TracedGraph(raw, exporter, key, {k: v.detach().clone() for k, v in model_weights(model).items()})

    def graph_for(self, model: torch.nn.Module, key: tuple[Any, ...]) -> ir.Model | None:
        """The kept graph with ``model``'s weights, or None (trace it)."""
        return self.traced.with_weights(model, key) if self.traced is not None else None


class TraceAhead:
    """A trace made on a thread of this process while it waits for other work (a run's host
    while its ranks start: ``LaterPhases.ahead``), for the exports that follow to reuse
    (``folded_onnx.trace_ahead`` makes one for an export's options).

    ``trace`` is called once, on the thread ``start`` begins; ``result`` waits for it. A trace
    that fails is logged and gives None: the export then traces as it always does, and says
    why if that fails too. ``trace`` holds ``MODEL_TRACING`` while it traces, as any export."""

    def __init__(self, trace: Callable[[], TracedGraph | None]) -> None:
        self._trace: Callable[[], TracedGraph | None] | None = trace
        self._traced: TracedGraph | None = None
        self._thread = threading.Thread(target=self._run, name="bnrecal-trace-ahead", daemon=True)

    def start(self) -> None:
        """Begin the trace on its thread."""
        self._thread.start()

    def result(self) -> TracedGraph | None:
        """The trace, once made (None if it failed, or was never started)."""
        if self._thread.ident is None:
            return None
        self._thread.join()
        return self._traced

    def _run(self) -> None:
        trace, self._trace = self._trace, None  # what it traces (a model's copy) is let go once traced
        assert trace is not None
        try:
            self._traced = trace()
        except Exception as exc:  # noqa: BLE001 - the export traces again, and reports its own failure
            logger.info("the export's trace ahead failed (%s); the export traces it", exc)


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model``, by the name the exporter gives its initializer."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}
