"""bnrecal from Python: recalibrate a live model's BatchNorm statistics, in place.

    import bnrecal

    report = bnrecal.recalibrate(model, loader, workers=2)   # like update_bn(loader, model)
    print(report)
    bnrecal.export_onnx(model, "model.onnx", sample)          # folded, verified ONNX

See docs/python.md. This package is only the public face: the code lives in ``service``
(``service.live``) and ``workers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.live import RecalibrationReport, export_onnx, recalibrate
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
    "ServiceUnavailableError", "SpecError", "UnsupportedLayerError", "export_onnx", "recalibrate",
]

if TYPE_CHECKING:
    from service.client import BnrecalClient


def __getattr__(name: str) -> Any:
    """``bnrecal.BnrecalClient`` imports the HTTP client (httpx) when first used: a training
    script that only recalibrates in its own process does not pay for it."""
    if name == "BnrecalClient":
        from service.client import BnrecalClient

        return BnrecalClient
    raise AttributeError(f"module 'bnrecal' has no attribute {name!r}")
