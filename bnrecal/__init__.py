"""bnrecal from Python: recalibrate a live model's BatchNorm statistics, in place.

    import bnrecal

    report = bnrecal.recalibrate(model, loader, workers=2)   # like update_bn(loader, model)
    print(report)
    bnrecal.export_onnx(model, "model.onnx", sample)          # folded, verified ONNX
    bnrecal.quantize(model, "model-int8.onnx", calibration)   # folded, INT8 (QDQ), checked

See docs/python.md. This package is only the public face: the code lives in ``service``
(``service.live``) and ``workers``.
"""

from __future__ import annotations

from service.client import BnrecalClient
from service.live import RecalibrationReport, export_onnx, quantize, recalibrate
from service.live.errors import (
    ArchitectureError,
    AuthenticationError,
    BnrecalError,
    CallOrderError,
    CancelledError,
    CheckpointError,
    DatasetError,
    ExportError,
    InputError,
    ModelInputError,
    NoBatchNormError,
    NotFoundError,
    PayloadTooLargeError,
    ProgramError,
    RunError,
    ServiceUnavailableError,
    SpecError,
    UnsupportedLayerError,
)

__all__ = [
    "ArchitectureError", "AuthenticationError", "BnrecalClient", "BnrecalError", "CallOrderError",
    "CancelledError", "CheckpointError", "DatasetError", "ExportError", "InputError", "ModelInputError",
    "NoBatchNormError", "NotFoundError", "PayloadTooLargeError", "ProgramError", "RecalibrationReport", "RunError",
    "ServiceUnavailableError", "SpecError", "UnsupportedLayerError", "export_onnx", "quantize", "recalibrate",
]
