"""The Python API behind ``import bnrecal``: recalibrate a caller's live model in place
(``run.py``), on Ray or as a job of a bnrecal server, many models at once (``many.py``), and
export it to folded ONNX, OpenVINO IR and INT8 (``onnx.py``)."""

from __future__ import annotations

from .many import CellResult, recalibrate_many
from .onnx import export_onnx, export_openvino, quantize
from .report import RecalibrationReport
from .run import recalibrate

__all__ = [
    "CellResult", "RecalibrationReport", "export_onnx", "export_openvino", "quantize", "recalibrate", "recalibrate_many",
]
