"""Run one of torch's ONNX exporters without letting it fold or split anything.

Both exporters in torch 2.14 fold the plain Conv -> BN case themselves, in float32 and
without the legality checks of docs/onnx.md, "What is folded", so neither is allowed to: the
``torch.export`` (dynamo) exporter runs with ``optimize=False`` (its optimizer applies
onnxscript's BatchNorm fusion rules), the TorchScript exporter with
``training=TrainingMode.PRESERVE`` on an eval model (which skips its eval-mode peephole
fusion but keeps constant folding). The result is an ``onnx_ir`` model in memory; saving
it (one file, no ``.onnx.data`` sidecar) is the caller's business.

The dynamo exporter is tried first (opset 18 and above); the TorchScript exporter is the
fallback where that fails, and the only path for opsets below 18.
"""

from __future__ import annotations

import functools
import inspect
import logging
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypedDict

import onnx_ir as ir
import torch

from bnrecal.workers.tracing import MODEL_TRACING
from bnrecal.service.export.opsets import DYNAMO_MAX_OPSET, DYNAMO_MIN_OPSET, TORCHSCRIPT_MAX_OPSET, TORCHSCRIPT_MIN_OPSET

logger = logging.getLogger(__name__)

INPUT_NAME = "input"
BATCH_AXIS = "batch"


@dataclass
class RawExport:
    """An exported, not yet folded graph and the exporter that made it."""

    model: ir.Model
    exporter: str


def output_names(count: int) -> list[str]:
    """Graph output names: ``output`` for one output, ``output_0..`` for several."""
    return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]


def _export_dynamo(model: torch.nn.Module, example: torch.Tensor, opset: int, dynamic_batch: bool,
                   n_outputs: int) -> ir.Model:
    dynamic_shapes = ({0: torch.export.Dim(BATCH_AXIS)},) if dynamic_batch else None
    options = _DynamoOptions(optimize=False, opset_version=opset, input_names=[INPUT_NAME],
                             output_names=output_names(n_outputs), verbose=False)
    entry = _dynamo_entry()
    if entry is None:
        program = torch.onnx.export(model, (example,), dynamo=True, external_data=False,
                                    dynamic_shapes=dynamic_shapes, **options)
    else:  # what torch.onnx.export does, with the translation table built once (torchlib_registry)
        shapes, named_axes = entry.dynamic_shapes.convert_str_to_export_dim(dynamic_shapes)
        program = entry.core.export(model, (example,), None, registry=torchlib_registry(opset),
                                    dynamic_shapes=shapes, **options)
        if named_axes and dynamic_shapes is not None:  # the batch axis called "batch", not torch's "s77"
            program._rename_dynamic_axes(dynamic_shapes)
    return program.model


class _DynamoOptions(TypedDict):
    """The options both dynamo calls (the public one and its own entry) take alike."""

    optimize: bool
    opset_version: int
    input_names: list[str]
    output_names: list[str]
    verbose: bool


@dataclass(frozen=True)
class _DynamoEntry:
    """The modules behind ``torch.onnx.export(dynamo=True)`` that take a prebuilt registry."""

    core: ModuleType
    registration: ModuleType
    constants: ModuleType
    dynamic_shapes: ModuleType


@functools.cache
def _dynamo_entry() -> _DynamoEntry | None:
    """The dynamo exporter's own entry (``_core.export``, which takes a registry) and what
    ``torch.onnx.export`` calls around it, where this torch has them as torch 2.14 does;
    None where it does not (the public call is used then)."""
    try:
        from torch.onnx._internal.exporter import _constants, _core, _dynamic_shapes, _onnx_program, _registration
    except ImportError:
        return None
    takes = set(inspect.signature(_core.export).parameters)
    if not ({"registry", "opset_version", "optimize", "dynamic_shapes"} <= takes
            and hasattr(_dynamic_shapes, "convert_str_to_export_dim")
            and hasattr(_onnx_program.ONNXProgram, "_rename_dynamic_axes")
            and hasattr(_registration.ONNXRegistry, "from_torchlib") and hasattr(_constants, "TORCHLIB_OPSET")):
        return None
    return _DynamoEntry(_core, _registration, _constants, _dynamic_shapes)


@functools.cache
def torchlib_registry(opset: int) -> Any:
    """torch's table of ATen-to-ONNX translations for a dynamo export at ``opset``, built
    once a process: ``torch.onnx.export`` builds it anew for every call (0.3-0.5 s of Python
    on this project's machines, the same table each time). The exporter only reads it, and
    exports run one at a time (``MODEL_TRACING``)."""
    entry = _dynamo_entry()
    if entry is None:
        raise RuntimeError("this torch's dynamo exporter takes no prebuilt registry")
    # As torch.onnx.export does: an opset below torchlib's own is translated at torchlib's, then converted.
    return entry.registration.ONNXRegistry().from_torchlib(opset_version=max(opset, entry.constants.TORCHLIB_OPSET))


def _export_torchscript(model: torch.nn.Module, example: torch.Tensor, opset: int, dynamic_batch: bool,
                        n_outputs: int) -> ir.Model:
    names = output_names(n_outputs)
    dynamic_axes = {name: {0: BATCH_AXIS} for name in (INPUT_NAME, *names)} if dynamic_batch else None
    with tempfile.TemporaryDirectory(prefix="bnrecal-export-") as tmp:
        path = Path(tmp) / "torchscript.onnx"
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=False,
            training=torch.onnx.TrainingMode.PRESERVE,
            opset_version=opset,
            input_names=[INPUT_NAME],
            output_names=names,
            dynamic_axes=dynamic_axes,
        )
        return ir.load(path)


def export_unfolded(
    model: torch.nn.Module,
    example: torch.Tensor,
    *,
    opset: int,
    dynamic_batch: bool,
    n_outputs: int,
    exporter: str = "auto",
) -> RawExport:
    """Export ``model`` (eval mode) at ``opset`` with one input batch ``example``.

    ``exporter`` is ``auto`` (dynamo, then TorchScript), ``dynamo`` or ``torchscript``.
    Raises the exporter's exception when no exporter succeeds.
    """
    candidates = []
    if exporter in ("auto", "dynamo") and DYNAMO_MIN_OPSET <= opset <= DYNAMO_MAX_OPSET:
        candidates.append(("dynamo", _export_dynamo))
    if exporter in ("auto", "torchscript") and TORCHSCRIPT_MIN_OPSET <= opset <= TORCHSCRIPT_MAX_OPSET:
        candidates.append(("torchscript", _export_torchscript))
    if not candidates:
        raise ValueError(f"no {exporter} exporter supports opset {opset}")
    errors: list[BaseException] = []
    for name, run in candidates:
        try:
            with MODEL_TRACING, warnings.catch_warnings():  # one export at a time (workers/tracing.py)
                warnings.simplefilter("ignore")  # deprecation notices of the TorchScript path, tracer hints
                return RawExport(run(model, example, opset, dynamic_batch, n_outputs), name)
        except Exception as exc:  # noqa: BLE001 - try the next exporter, report the first failure
            logger.info("%s exporter failed: %s", name, exc)
            errors.append(exc)
    raise errors[0]
