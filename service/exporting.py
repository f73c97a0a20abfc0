"""Exporting a recalibrated model to folded ONNX, with the samples that verify it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .recalibrate import Recalibration

VERIFY_SAMPLES = 8
"""Calibration samples used to verify an export (batch 1 and this batch)."""


def export_recalibrated(
    result: Recalibration,
    path: str | os.PathLike[str],
    *,
    opset: int = 18,
    dtype: str = "float32",
    dynamic_batch: bool = True,
    input_shape: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Fold and export the recalibrated model, verified on its own calibration samples.

    Returns the report's ``onnx`` section; raises ``ExportError`` (and writes nothing)
    when the export cannot be verified.
    """
    from .export import export_folded_onnx

    samples = result.calibration_samples(VERIFY_SAMPLES)
    return export_folded_onnx(
        result.model, samples, path, opset=opset, dtype=dtype, dynamic_batch=dynamic_batch, input_shape=input_shape
    )
