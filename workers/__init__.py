"""Pure torch + Ray workers: BN discovery, calibration math, sharding, data, actors.

The math (``BatchNormCalibrator``, ``calibration_pass``) runs in any process; the Ray
side (``run_rank_group``) places one ``CalibrationRank`` actor per rank.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "batchnorm": ("BatchNormLayer", "SkippedLayer", "find_batchnorm_layers"),
    "calibrator": ("BatchNormCalibrator", "probe_call_order"),
    "calibration": ("PassResult", "apply_statistics", "calibration_pass"),
    "checkpoints": ("Checkpoint", "load_checkpoint", "load_into_model", "save_checkpoint"),
    "collectives": ("Collective", "RayCollective", "SingleProcessCollective", "backend_for_device"),
    "errors": (
        "ArchitectureError", "AuthenticationError", "BnrecalError", "CallOrderError", "CancelledError",
        "CheckpointError",
        "DatasetError", "ExportError", "InputError", "ModelInputError", "NoBatchNormError", "NotFoundError",
        "PayloadTooLargeError", "RunError", "SpecError", "UnsupportedLayerError",
    ),
    "group": ("GroupOptions", "GroupResult", "run_rank_group"),
    "models": ("build_model", "parse_allowed_modules"),
    "moments": ("MomentStats",),
    "plan": ("RankPlan",),
    "sharding": ("num_steps", "rank_ranges"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """Import public names on first use, so ``workers.errors`` users do not pay for torch and Ray."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'workers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ArchitectureError",
    "AuthenticationError",
    "BatchNormCalibrator",
    "BatchNormLayer",
    "BnrecalError",
    "CallOrderError",
    "CancelledError",
    "Checkpoint",
    "CheckpointError",
    "Collective",
    "DatasetError",
    "ExportError",
    "GroupOptions",
    "GroupResult",
    "InputError",
    "ModelInputError",
    "MomentStats",
    "NoBatchNormError",
    "NotFoundError",
    "PassResult",
    "PayloadTooLargeError",
    "RankPlan",
    "RayCollective",
    "RunError",
    "SingleProcessCollective",
    "SkippedLayer",
    "SpecError",
    "UnsupportedLayerError",
    "apply_statistics",
    "backend_for_device",
    "build_model",
    "calibration_pass",
    "find_batchnorm_layers",
    "load_checkpoint",
    "load_into_model",
    "num_steps",
    "parse_allowed_modules",
    "rank_ranges",
    "probe_call_order",
    "run_rank_group",
    "save_checkpoint",
]
