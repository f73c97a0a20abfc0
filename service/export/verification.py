"""Check an exported ONNX file against the PyTorch model it came from, in onnxruntime.

onnxruntime runs with graph optimizations disabled, so the file is judged as written
(its own fusions could otherwise hide or cause a difference). Tolerances, with
``scale = max(1, max|y|)`` over the PyTorch outputs of a batch:

- float32 export: ``max|y_onnx - y_torch| <= 1e-4 * scale`` (docs/onnx.md, "The file");
- float16 export: ``max|y_onnx - y_torch| <= 2e-2 * scale``; float16 keeps about 3
  significant digits per op, so the error of a deep network compounds to ~1e-3..1e-2
  of the output scale (measured on resnet18, mobilenet_v3_small, efficientnet_b0 and
  densenet121); a wrong fold shows up as O(scale).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bnrecal.errors import ExportError, first_line

TOLERANCE = {"float32": 1e-4, "float16": 2e-2}

VERIFY_SAMPLES = 8
"""Samples an exported file (FP32, float16 or INT8) is verified on: batch 1 and a batch of these."""


@dataclass
class VerificationResult:
    """Largest differences over every verified batch, and the batch sizes verified."""

    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    verified_batches: list[int] = field(default_factory=list)


def flatten_outputs(outputs: object) -> list[torch.Tensor]:
    """The tensors of a model's output in the exporters' order (tuples, lists, dict values)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, dict):
        return [t for value in outputs.values() for t in flatten_outputs(value)]
    if isinstance(outputs, (list, tuple)):
        return [t for value in outputs for t in flatten_outputs(value)]
    return []


def reference_outputs(model: torch.nn.Module, batch: torch.Tensor) -> list[np.ndarray]:
    """Run the PyTorch model (already in eval mode) on ``batch``; outputs as numpy."""
    with torch.no_grad():
        return [t.detach().cpu().numpy() for t in flatten_outputs(model(batch))]


def _session(model: Path | bytes):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = min(4, os.cpu_count() or 1)
    options.log_severity_level = 3
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def verify_onnx(
    model: Path | bytes,
    batches: Sequence[torch.Tensor],
    references: Sequence[Sequence[np.ndarray]],
    dtype: str,
) -> VerificationResult:
    """Run the ONNX model (a file, or serialized bytes) on each batch; compare with ``references``.

    Raises ExportError, one line naming the batch, output and difference, on any mismatch,
    non-finite output, or failure of onnxruntime to load or run the file.
    """
    try:
        session = _session(model)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise ExportError(f"onnxruntime cannot load the exported model: {first_line(exc)}") from exc
    input_name = session.get_inputs()[0].name
    np_dtype = np.float16 if dtype == "float16" else np.float32
    result = VerificationResult()
    for batch, expected in zip(batches, references):
        try:
            got = session.run(None, {input_name: batch.detach().cpu().numpy().astype(np_dtype)})
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"onnxruntime fails on a batch of {len(batch)}: {first_line(exc)}") from exc
        if len(got) != len(expected):
            raise ExportError(f"ONNX model returns {len(got)} outputs, PyTorch {len(expected)}")
        for index, (onnx_out, torch_out) in enumerate(zip(got, expected)):
            if onnx_out.shape != torch_out.shape:
                raise ExportError(
                    f"ONNX output {index} has shape {list(onnx_out.shape)} at batch {len(batch)}, "
                    f"PyTorch {list(torch_out.shape)}"
                )
            if not np.issubdtype(torch_out.dtype, np.floating):
                if not np.array_equal(onnx_out, torch_out):
                    raise ExportError(f"ONNX output {index} differs from PyTorch at batch {len(batch)}")
                continue
            reference = torch_out.astype(np.float64)
            if not np.all(np.isfinite(onnx_out)):
                raise ExportError(f"ONNX output {index} is not finite at batch {len(batch)} ({dtype} overflow?)")
            peak = float(np.max(np.abs(reference))) if reference.size else 0.0
            abs_diff = float(np.max(np.abs(onnx_out.astype(np.float64) - reference))) if reference.size else 0.0
            scale = max(1.0, peak)
            if not abs_diff <= TOLERANCE[dtype] * scale:
                raise ExportError(
                    f"ONNX output {index} differs from PyTorch by {abs_diff:.3g} at batch {len(batch)} "
                    f"(allowed {TOLERANCE[dtype] * scale:.3g} for {dtype}); no file written"
                )
            result.max_abs_diff = max(result.max_abs_diff, abs_diff)
            result.max_rel_diff = max(result.max_rel_diff, abs_diff / peak if peak > 0 else abs_diff)
        result.verified_batches.append(len(batch))
    return result


def onnx_outputs(model: bytes, batches: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
    """onnxruntime's outputs of the ONNX ``model`` as written (graph optimizations off) on
    each float32 batch: the reference a file made from it is held to. Raises ``ExportError``
    when onnxruntime cannot load or run it."""
    try:
        session = _session(model)
        name = session.get_inputs()[0].name
        return [session.run(None, {name: batch}) for batch in batches]
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise ExportError(f"cannot be run in onnxruntime: {first_line(exc)}") from exc
