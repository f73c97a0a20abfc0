"""The errors ``import bnrecal`` users catch: every failure is a :class:`BnrecalError`
subclass with a one-line message (the same types the CLI and the HTTP API report)."""

from __future__ import annotations

from bnrecal.workers.errors import (
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
    "ArchitectureError", "AuthenticationError", "BnrecalError", "CallOrderError", "CancelledError",
    "CheckpointError", "DatasetError", "ExportError", "InputError", "ModelInputError", "NoBatchNormError",
    "NotFoundError", "PayloadTooLargeError", "ProgramError", "RunError", "ServiceUnavailableError", "SpecError",
    "UnsupportedLayerError",
]
