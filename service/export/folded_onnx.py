"""``export_folded_onnx``: the recalibrated model as one verified, BN-folded ONNX file."""

from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Literal

import numpy as np
import onnx_ir as ir
import torch
import torch.nn.functional as F

from bnrecal.errors import BnrecalError, ExportError, first_line
from bnrecal.workers.files import atomic_write

from bnrecal.service.export.exporters import export_unfolded
from bnrecal.service.export.opsets import DEFAULT_OPSET, SUPPORTED_OPSETS
from bnrecal.service.export.float16 import convert_to_float16
from bnrecal.service.export.graph_reuse import GraphReuse, TraceAhead, TracedGraph
from bnrecal.service.export.graph_passes import (
    batchnorm_count,
    check_final_model,
    check_size,
    finalize,
    fold_constants,
    globalize_whole_input_pools,
)
from bnrecal.service.export.folding.in_onnx import OnnxFoldResult, fold_batchnorm_nodes
from bnrecal.service.export.report_sections import OnnxSection, RuntimeChecks, RuntimeEntry, UnfoldedLayer
from bnrecal.service.export.runtimes import (
    RuntimeRun, largest_difference, onnxruntime_version, runtime_entry, start_openvino, warm_openvino,
)
from bnrecal.service.export.folding.in_torch import TorchFoldResult, fold_batchnorm_modules
from bnrecal.service.export.verification import (
    TOLERANCE, VerificationResult, flatten_outputs, reference_outputs, verify_onnx,
)
from bnrecal.workers.tracing import holds_tracing

logger = logging.getLogger(__name__)

LARGE_VERIFY_BATCH = 8


def _validate(samples: torch.Tensor, opset: int, dtype: str, input_shape: Sequence[int] | None) -> None:
    if not isinstance(samples, torch.Tensor) or samples.is_complex() or samples.dtype == torch.bool:
        raise ExportError("ONNX export needs calibration samples as a real-valued tensor")
    if samples.dim() < 2 or samples.shape[0] < 2:
        raise ExportError(f"ONNX export needs at least 2 calibration samples, got shape {list(samples.shape)}")
    if opset not in SUPPORTED_OPSETS:
        raise ExportError(
            f"ONNX opset {opset} is not supported; choose {SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1}"
        )
    if dtype not in ("float32", "float16"):
        raise ExportError(f"ONNX dtype '{dtype}' is not supported; choose float32 or float16")
    if input_shape is not None:
        shape = list(input_shape)
        if len(shape) != samples.dim() - 1 or any(not isinstance(d, int) or d < 1 for d in shape):
            raise ExportError(
                f"ONNX input_shape {shape} does not fit samples of per-sample shape {list(samples.shape[1:])}"
            )
        if shape[0] != samples.shape[1]:
            raise ExportError(f"ONNX input_shape {shape} has {shape[0]} channels, the samples {samples.shape[1]}")


def _shaped_samples(samples: torch.Tensor, input_shape: Sequence[int] | None) -> torch.Tensor:
    """The samples at the export's per-sample shape (spatially resized where it differs)."""
    samples = samples.detach().to(torch.float32).cpu()
    if input_shape is None or list(input_shape) == list(samples.shape[1:]):
        return samples
    size = list(input_shape)[1:]
    mode = {1: "linear", 2: "bilinear", 3: "trilinear"}.get(len(size))
    if mode is None:
        raise ExportError(f"ONNX input_shape {list(input_shape)} has no spatial size the samples can be resized to")
    return F.interpolate(samples, size=size, mode=mode, align_corners=False)


def export_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A fresh copy of ``model`` to export: float32 on the CPU, in eval mode, every parameter
    and buffer contiguous in the default memory format.

    The file must not depend on the path that made the model: a run that evaluated the
    model on its driver (a one-worker run) left it channels-last, and the exporter then
    wrote an ``as_strided`` Gather/Range/Mul subgraph (113 nodes instead of mobilenet_v2's
    104) that OpenVINO computed wrong at a dynamic batch (docs/onnx.md, "The file").
    """
    fresh = copy.deepcopy(model).to(device="cpu", dtype=torch.float32).eval()
    with torch.no_grad():
        for tensor in (*fresh.parameters(), *fresh.buffers()):
            # a clone, not ``.contiguous()``: a 1x1 conv weight in channels-last strides counts as
            # contiguous, yet steers the layout its conv computes (and exports) in
            tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
    return fresh


def check_in_openvino(started: Future[RuntimeRun], references: Sequence[Sequence[np.ndarray]],
                      tolerance: float, what: str) -> RuntimeEntry:
    """Wait for the file's run in OpenVINO (``start_openvino``, begun beside its check in
    onnxruntime) and hold it to ``references`` at ``tolerance`` (times ``max(1, max|y|)``, as
    onnxruntime is held); the report's ``openvino`` entry. Raises ``ExportError`` (one line)
    when OpenVINO cannot run it or disagrees."""
    try:
        run = started.result()
        if run.outputs is None:
            return runtime_entry(run)
        diff, peak = largest_difference(run.outputs, references)
    except (RuntimeError, ValueError) as exc:
        raise ExportError(f"{what} fails in OpenVINO: {first_line(exc)}; no file written") from exc
    if not diff <= tolerance * max(1.0, peak):
        raise ExportError(
            f"{what} differs in OpenVINO by {diff:.3g} (allowed {tolerance * max(1.0, peak):.3g}); no file written"
        )
    return runtime_entry(run, diff)


def _root_cause(exc: BaseException) -> str:
    """One line naming the innermost cause of an exporter failure (torch wraps it twice)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def _fold_in_torch(model: torch.nn.Module, example: torch.Tensor) -> tuple[torch.nn.Module, TorchFoldResult]:
    """Fold on a copy; where the folded copy no longer runs, keep the unfolded model."""
    folded = copy.deepcopy(model)
    result = fold_batchnorm_modules(folded, example)
    try:
        with torch.no_grad():
            folded(example)
    except Exception as exc:  # noqa: BLE001 - e.g. a forward that reads attributes of the removed BN
        logger.info("model does not run with BN modules removed (%s); folding on the ONNX graph only", exc)
        return model, TorchFoldResult(method="none")
    return folded, result


def _traced_graph(
    model: torch.nn.Module, example: torch.Tensor, *, opset: int, dynamic_batch: bool, n_outputs: int,
    exporter: str, torch_fold: bool, reuse: GraphReuse | None,
) -> tuple[ir.Model, TorchFoldResult, str]:
    """Fold in PyTorch, then the exporter's graph (``reuse``'s, with this model's weights,
    where it traced one of the same structure), and the exporter that made it."""
    torch_result = TorchFoldResult(method="none")
    if torch_fold and any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        model, torch_result = _fold_in_torch(model, example)
    key = (opset, dynamic_batch, n_outputs, exporter, tuple(example.shape[1:]), torch_result.method,
           tuple(torch_result.folded))
    graph = reuse.graph_for(model, key) if reuse is not None else None
    if graph is not None:
        return graph, torch_result, "dynamo (the graph traced for a model of the same structure)"
    raw = export_unfolded(model, example, opset=opset, dynamic_batch=dynamic_batch, n_outputs=n_outputs,
                          exporter=exporter)
    if reuse is not None:
        reuse.keep(raw.model, raw.exporter, key, model)
    return raw.model, torch_result, raw.exporter


def _export_graph(
    model: torch.nn.Module, example: torch.Tensor, *, opset: int, dynamic_batch: bool, n_outputs: int,
    exporter: str, torch_fold: bool, reuse: GraphReuse | None = None,
) -> tuple[ir.Model, TorchFoldResult, OnnxFoldResult, str]:
    """Fold in PyTorch, export (or take ``reuse``'s graph of the same structure with this
    model's weights), fold on the graph: the float32 graph and what each pass did."""
    graph, torch_result, used = _traced_graph(model, example, opset=opset, dynamic_batch=dynamic_batch,
                                              n_outputs=n_outputs, exporter=exporter, torch_fold=torch_fold, reuse=reuse)
    fold_constants(graph)
    globalize_whole_input_pools(graph)  # a window over the whole input, as OpenVINO reads it
    onnx_result = fold_batchnorm_nodes(graph)
    finalize(graph)
    return graph, torch_result, onnx_result, used


def _export_inputs(
    model: torch.nn.Module, samples: torch.Tensor, *, opset: int, dtype: str, input_shape: Sequence[int] | None,
    dynamic_batch: bool, fixed_batch: int,
) -> tuple[torch.Tensor, torch.nn.Module, torch.Tensor]:
    """What an export and a trace made ahead of it start from, alike (the trace is reused only
    where its key matches): the samples at the export's per-sample shape, the model's export
    copy (``export_copy``) and the example the exporter traces with."""
    _validate(samples, opset, dtype, input_shape)
    shaped = _shaped_samples(samples, input_shape)
    if not dynamic_batch and not 1 <= fixed_batch <= len(shaped):
        raise ExportError(f"a fixed batch of {fixed_batch} needs that many samples to export; got {len(shaped)}")
    return shaped, export_copy(model), shaped[:2] if dynamic_batch else shaped[:fixed_batch]


def trace_ahead(
    model: torch.nn.Module,
    samples: torch.Tensor,
    *,
    opset: int = DEFAULT_OPSET,
    dynamic_batch: bool = True,
    input_shape: Sequence[int] | None = None,
    fixed_batch: int = 1,
) -> TraceAhead:
    """The exporter's trace that ``export_folded_onnx`` with the same options makes of a model
    of ``model``'s structure, to be made on a thread (``TraceAhead``: ``start``, then
    ``result``) without its export: for an export of another model of that structure to
    reuse (``reuse=GraphReuse(traced)``) instead of tracing. A run traces its model while the
    ranks compute the statistics, which the trace does not depend on (folds depend on the
    structure only); the export puts its own weights in and is verified as always.
    ``samples`` need only have the export's per-sample shape. ``model`` is copied here, so
    the caller may change it once this returns; the trace gives None where the model returns
    no tensor."""
    _, reference, example = _export_inputs(model, samples, opset=opset, dtype="float32", input_shape=input_shape,
                                           dynamic_batch=dynamic_batch, fixed_batch=fixed_batch)

    @holds_tracing
    def trace() -> TracedGraph | None:
        with torch.no_grad():
            n_outputs = len(flatten_outputs(reference(example)))
        if n_outputs == 0:
            return None
        reuse = GraphReuse()
        _traced_graph(reference, example, opset=opset, dynamic_batch=dynamic_batch, n_outputs=n_outputs,
                      exporter="auto", torch_fold=True, reuse=reuse)
        return reuse.traced

    return TraceAhead(trace)


@holds_tracing
def export_folded_onnx(
    model: torch.nn.Module,
    samples: torch.Tensor,
    path: str | os.PathLike,
    *,
    opset: int = DEFAULT_OPSET,
    dtype: Literal["float32", "float16"] = "float32",
    dynamic_batch: bool = True,
    input_shape: Sequence[int] | None = None,
    fixed_batch: int = 1,
    reuse: GraphReuse | None = None,
    openvino: bool = True,
    _exporter: str = "auto",
    _torch_fold: bool = True,
) -> OnnxSection:
    """Fold BN, export one verified .onnx file at `path`; return the report's `onnx` section
    (its folds, what stayed unfolded, its verification and its size).

    ``model`` is left untouched (a deep copy is folded, in eval mode). ``samples`` (N >= 2)
    give the export shape and the verification inputs: onnxruntime, optimizations off,
    against the unfolded PyTorch model at batch 1 and at batch min(N, 8) (with
    ``dynamic_batch=False``, only at ``fixed_batch``, the fixed batch it exports: 1, or a
    program's static batch). ``input_shape`` is the
    per-sample shape to export at; samples of another spatial size are resized to it for
    verification. ``reuse`` carries a traced graph from one export to the next of a model
    of the same structure (``graph_reuse``: the stale model beside the recalibrated one);
    ``openvino=False`` leaves out the OpenVINO check (a file nobody deploys, such as that
    stale model's, is verified in onnxruntime only). Any failure raises ExportError and
    leaves no file at ``path``: the model is written beside it and renamed into place only
    once verified. ``_exporter``
    (``auto``/``dynamo``/``torchscript``) and ``_torch_fold`` exist for tests.
    """
    shaped, reference, example = _export_inputs(model, samples, opset=opset, dtype=dtype, input_shape=input_shape,
                                                dynamic_batch=dynamic_batch, fixed_batch=fixed_batch)
    if openvino:
        warm_openvino()  # OpenVINO loads in its own process while the model is traced
    batches = [shaped[:1], shaped[:LARGE_VERIFY_BATCH]] if dynamic_batch else [shaped[:fixed_batch]]
    try:
        references = [reference_outputs(reference, batch) for batch in batches]
        with torch.no_grad():
            n_outputs = len(flatten_outputs(reference(example)))
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"the model fails on the calibration samples before export: {_root_cause(exc)}") from exc
    if n_outputs == 0:
        raise ExportError("the model returns no tensor; nothing to export to ONNX")
    try:
        graph, torch_result, onnx_result, exporter = _export_graph(
            reference, example, opset=opset, dynamic_batch=dynamic_batch, n_outputs=n_outputs,
            exporter=_exporter, torch_fold=_torch_fold, reuse=reuse,
        )
        check_size(graph)
        proto = ir.serde.serialize_model(graph)
        if dtype == "float16":  # the folds are verified at float32 tolerance before the cast
            check_final_model(graph, proto, opset)
            verify_onnx(proto.SerializeToString(), batches, references, "float32")
            convert_to_float16(graph, opset, {**torch_result.rewritten, **onnx_result.rewritten})
            proto = ir.serde.serialize_model(graph)
        check_final_model(graph, proto, opset)
    except BnrecalError:
        raise
    except Exception as exc:  # noqa: BLE001 - exporter and pass failures become one-line ExportErrors
        raise ExportError(f"ONNX export failed: {_root_cause(exc)}") from exc
    target = Path(path)
    def write_and_verify(temp: Path) -> tuple[VerificationResult, RuntimeEntry, int]:
        serialized = proto.SerializeToString()
        temp.write_bytes(serialized)
        np_dtype = np.float16 if dtype == "float16" else np.float32
        # OpenVINO runs the file in its own process while onnxruntime verifies it here
        started = start_openvino(serialized, [b.numpy().astype(np_dtype) for b in batches]) if openvino else None
        verified = verify_onnx(temp, batches, references, dtype)
        in_openvino = check_in_openvino(
            started, references, TOLERANCE[dtype], "the exported model"
        ) if started is not None else RuntimeEntry(ran=False, reason="not checked: a file made only to be measured, not deployed")
        return verified, in_openvino, len(serialized)

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # the usual file mode; nothing at the target unless verified
        verified, in_openvino, size = atomic_write(target, write_and_verify)
    except OSError as exc:
        raise ExportError(f"cannot write the ONNX file '{target}': {exc.strerror or exc}") from exc
    logger.info("exported %s via %s: %d BN folded in PyTorch (%s), %d on the graph, %d left",
                target, exporter, len(torch_result.folded), torch_result.method, len(onnx_result.folded),
                len(onnx_result.unfolded))
    return OnnxSection(
        opset=opset,
        dtype=dtype,
        batch="dynamic" if dynamic_batch else fixed_batch,
        batchnorm_nodes=batchnorm_count(proto),
        folded=len(torch_result.folded) + len(onnx_result.folded),
        unfolded=[UnfoldedLayer(name=name, reason=reason) for name, reason in onnx_result.unfolded],
        max_abs_diff=verified.max_abs_diff,
        max_rel_diff=verified.max_rel_diff,
        verified_batches=verified.verified_batches,
        bytes=size,
        runtimes=RuntimeChecks(
            reference="the PyTorch model, on the verified batches",
            onnxruntime=RuntimeEntry(ran=True, version=onnxruntime_version(), max_abs_diff=verified.max_abs_diff),
            openvino=in_openvino,
        ),
    )
