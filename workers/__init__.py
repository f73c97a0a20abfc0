"""Pure torch + Ray workers: BN discovery, calibration math, sharding, data, actors.

The math (``BatchNormCalibrator``, ``calibration_pass``) runs in any process; the Ray
side (``run_rank_group``) places one ``CalibrationRank`` actor per rank.
"""

from .batchnorm import BatchNormCalibrator, BatchNormLayer, SkippedLayer, find_batchnorm_layers, record_call_order
from .calibration import PassResult, apply_statistics, calibration_pass
from .checkpoints import Checkpoint, load_checkpoint, load_into_model, save_checkpoint
from .collectives import Collective, RayCollective, SingleProcessCollective, backend_for_device
from .errors import (
    ArchitectureError,
    AuthenticationError,
    BnrecalError,
    CancelledError,
    CheckpointError,
    DatasetError,
    ExportError,
    InputError,
    ModelInputError,
    NoBatchNormError,
    NotFoundError,
    PayloadTooLargeError,
    RunError,
    SpecError,
)
from .group import GroupOptions, GroupResult, run_rank_group
from .models import build_model, parse_allowed_modules
from .moments import MomentStats
from .plan import RankPlan
from .sharding import num_steps, rank_ranges

__all__ = [
    "ArchitectureError",
    "AuthenticationError",
    "BatchNormCalibrator",
    "BatchNormLayer",
    "BnrecalError",
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
    "record_call_order",
    "run_rank_group",
    "save_checkpoint",
]
