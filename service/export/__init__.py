"""Folded, verified ONNX export of a recalibrated model (docs/onnx.md; its report section:
docs/report.md, "The `onnx` section").

BatchNorm layers are folded in PyTorch on the traced dataflow, then on the exported
ONNX graph for whatever is left; the file is checked with ``onnx.checker`` (full check)
and verified in onnxruntime against the PyTorch model before it is written. Names are imported
on first use, so the run options can take the opsets (``opsets``) without loading torch.
This room imports ``workers`` only: the run pipeline (``service.run``) builds on it.
"""

from __future__ import annotations

from bnrecal.workers.lazy import lazy_exports

_HOMES = {
    "opsets": ("DEFAULT_OPSET", "SUPPORTED_OPSETS"),
    "folded_onnx": ("export_folded_onnx", "trace_ahead"),
    "verification": ("TOLERANCE",),
}
__getattr__, __all__ = lazy_exports(__name__, _HOMES)
