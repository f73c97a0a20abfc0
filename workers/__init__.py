"""Pure torch + Ray workers, in rooms by what they do.

- ``engine/``: the calibrating forward and its math (BN discovery, moments, one rank's
  passes), no Ray: it runs in any process.
- ``models/``: building models, checkpoints and model sources.
- ``programs/``: ``torch.export`` programs loaded without running code from the file.
- ``data/``: calibration data, described once and read in row ranges by each rank.
- ``ranks/``: the Ray side: rank actors, their group and warm pool, sharding, the collective.

At the top stay the helpers every room shares (the one error hierarchy is
:mod:`bnrecal.errors`, above every package): durable file writes (``files``), name suggestions (``suggestions``) and lazy exports
(``lazy``). Rooms import downwards only: ``ranks`` -> ``models`` -> ``programs`` ->
``engine`` -> ``data``; ``tests/test_import_graph.py`` holds them to it.
"""

from __future__ import annotations

from .lazy import lazy_exports

_HOMES = {
    "engine.batchnorm": ("BatchNormLayer", "SkippedLayer", "find_batchnorm_layers"),
    "engine.calibrator": ("BatchNormCalibrator", "probe_call_order"),
    "engine.statistics_pass": ("PassResult", "apply_statistics", "calibration_pass"),
    "models.checkpoints": ("Checkpoint", "load_checkpoint", "load_into_model", "save_checkpoint"),
    "engine.collective": ("Collective", "SingleProcessCollective"),
    "ranks.process.ray_collective": ("RayCollective", "backend_for_device"),
    "ranks.group": ("GroupOptions", "GroupResult", "run_rank_group"),
    "models.architectures": ("build_model", "parse_allowed_modules"),
    "engine.moments": ("MomentStats",),
    "ranks.plan": ("RankPlan",),
    "ranks.gangs.pool": ("Gang", "GangKey", "WarmPool"),
    "ranks.sharding": ("num_steps", "rank_ranges"),
}
__getattr__, __all__ = lazy_exports(__name__, _HOMES)
