"""The exported files run in a second runtime, OpenVINO (its CPU plugin, dynamic batch),
beside onnxruntime (docs/onnx.md, "The file"; docs/int8.md, "Checks and the report's `int8` section").

onnxruntime alone can accept a graph another deployer's runtime reads differently (a
memory-format subgraph that OpenVINO computed wrong at a dynamic batch showed this), so
every file is also compiled and run by OpenVINO on the batches onnxruntime verified, and
compared with the same reference at the same tolerance. OpenVINO computes float layers in
float32 here (``INFERENCE_PRECISION_HINT: f32``): its CPU plugin would otherwise pick
bfloat16 on CPUs that have it, and judge the file at a precision it was not written in.

OpenVINO is optional (the ``test`` extra installs it); without it the report says
``{"ran": false, "reason": "openvino is not installed"}`` and only onnxruntime judges the file.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bnrecal.errors import first_line

OPENVINO_CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}


@dataclass(frozen=True)
class RuntimeRun:
    """One runtime's outputs on each batch, or why it did not run (``outputs`` None)."""

    runtime: str
    version: str
    outputs: list[list[np.ndarray]] | None
    reason: str = ""


def openvino_version() -> str | None:
    """OpenVINO's version, or None when it is not installed."""
    try:
        import openvino
    except ImportError:
        return None
    return str(openvino.__version__).split("-")[0]


def run_openvino(model: Path | bytes, batches: Sequence[np.ndarray]) -> RuntimeRun:
    """Compile ``model`` (a file or serialized bytes) for OpenVINO's CPU plugin as written
    (dynamic batch kept dynamic) and run it on each batch. Raises ``RuntimeError`` with
    one line when OpenVINO cannot read, compile or run it."""
    version = openvino_version()
    if version is None:
        return RuntimeRun("openvino", "", None, "openvino is not installed")
    import openvino as ov

    source = model.read_bytes() if isinstance(model, Path) else model
    core = ov.Core()
    config: dict[str, Any] = {**OPENVINO_CONFIG, "INFERENCE_NUM_THREADS": min(4, os.cpu_count() or 1)}
    try:
        compiled = core.compile_model(core.read_model(io.BytesIO(source)), "CPU", config)
    except Exception as exc:  # noqa: BLE001 - OpenVINO raises its own types
        raise RuntimeError(f"OpenVINO cannot compile the model: {first_line(exc)}") from exc
    request = compiled.create_infer_request()
    outputs: list[list[np.ndarray]] = []
    for batch in batches:
        try:
            result = request.infer({0: batch})
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"OpenVINO fails on a batch of {len(batch)}: {first_line(exc)}") from exc
        outputs.append([np.array(result[port]) for port in compiled.outputs])
    return RuntimeRun("openvino", version, outputs)


def largest_difference(got: Sequence[Sequence[np.ndarray]], expected: Sequence[Sequence[np.ndarray]]) -> tuple[float, float]:
    """The largest ``|got - expected|`` over every batch and floating output, and the largest
    ``|expected|`` (the outputs' scale). Raises ``ValueError`` naming the first output whose
    count, shape or finiteness differs."""
    worst = scale = 0.0
    for b, (outs, refs) in enumerate(zip(got, expected, strict=True)):
        if len(outs) != len(refs):
            raise ValueError(f"returns {len(outs)} outputs, expected {len(refs)}")
        for index, (a, r) in enumerate(zip(outs, refs)):
            if a.shape != r.shape:
                raise ValueError(f"output {index} has shape {list(a.shape)} at batch {b}, expected {list(r.shape)}")
            if not np.issubdtype(r.dtype, np.floating) or r.size == 0:
                continue
            if not np.all(np.isfinite(a)):
                raise ValueError(f"output {index} is not finite")
            worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - r.astype(np.float64)))))
            scale = max(scale, float(np.max(np.abs(r))))
    return worst, scale


def runtime_entry(run: RuntimeRun, max_abs_diff: float | None = None, **extra: Any) -> dict[str, Any]:
    """The report's entry for one runtime: whether it ran the file, its version, its
    agreement (``max_abs_diff`` against the reference named by the section)."""
    if run.outputs is None:
        return {"ran": False, "reason": run.reason}
    entry: dict[str, Any] = {"ran": True, "version": run.version}
    if max_abs_diff is not None:
        entry["max_abs_diff"] = max_abs_diff
    entry.update(extra)
    return entry


def onnxruntime_version() -> str:
    """onnxruntime's version."""
    import onnxruntime

    return str(onnxruntime.__version__)
