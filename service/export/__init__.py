"""Folded, verified ONNX export of a recalibrated model (contract sections 5 and 6).

BatchNorm layers are folded in PyTorch on the traced dataflow, then on the exported
ONNX graph for whatever is left; the file is checked with ``onnx.checker`` (full check)
and verified in onnxruntime against the PyTorch model before it is written.
"""

from __future__ import annotations

from service.export.exporters import SUPPORTED_OPSETS
from service.export.folded_onnx import DEFAULT_OPSET, export_folded_onnx
from service.export.verification import TOLERANCE

__all__ = ["DEFAULT_OPSET", "SUPPORTED_OPSETS", "TOLERANCE", "export_folded_onnx"]
