"""The Python API behind ``import bnrecal``: recalibrate a caller's live model in place
(``run.py``), on Ray or as a job of a bnrecal server, and export it to folded ONNX."""

from __future__ import annotations

from .onnx import export_onnx, quantize
from .report import RecalibrationReport
from .run import recalibrate

__all__ = ["RecalibrationReport", "export_onnx", "quantize", "recalibrate"]
