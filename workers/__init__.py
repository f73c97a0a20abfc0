"""Pure torch + Ray workers: BN discovery, calibration math, sharding, data, actors.

The math (``BatchNormCalibrator``, ``calibration_pass``) runs in any process; the Ray
side (``run_rank_group``) places one ``CalibrationRank`` actor per rank, or reuses a warm
gang of them (``WarmPool``).
"""

from __future__ import annotations

from .lazy import lazy_exports

_HOMES = {
    "batchnorm": ("BatchNormLayer", "SkippedLayer", "find_batchnorm_layers"),
    "calibrator": ("BatchNormCalibrator", "probe_call_order"),
    "calibration": ("PassResult", "apply_statistics", "calibration_pass"),
    "checkpoints": ("Checkpoint", "load_checkpoint", "load_into_model", "save_checkpoint"),
    "collectives": ("Collective", "RayCollective", "SingleProcessCollective", "backend_for_device"),
    "errors": (
        "ArchitectureError", "AuthenticationError", "BnrecalError", "CallOrderError", "CancelledError",
        "CheckpointError", "DatasetError", "ExportError", "InputError", "InsufficientStorageError",
        "ModelInputError", "NoBatchNormError", "NotFoundError", "PayloadTooLargeError", "ProgramError", "QuotaExceededError",
        "RunError", "ServiceUnavailableError", "SpecError", "UnsupportedLayerError",
    ),
    "group": ("GroupOptions", "GroupResult", "run_rank_group"),
    "models": ("build_model", "parse_allowed_modules"),
    "moments": ("MomentStats",),
    "plan": ("RankPlan",),
    "pool": ("Gang", "GangKey", "WarmPool"),
    "sharding": ("num_steps", "rank_ranges"),
}
__getattr__, __all__ = lazy_exports(__name__, _HOMES)
