"""The bnrecal service core: recalibration runs, folded ONNX export, jobs, blobs, settings,
the HTTP client and the CLI. The HTTP app itself lives in ``api`` (``api.create_app``).

Public names are imported on first use, so the CLI starts without loading torch or Ray.
"""

from __future__ import annotations

from bnrecal.workers.lazy import lazy_exports

_HOMES = {
    "run.recalibrate": ("Recalibration", "RecalibrationRequest", "recalibrate"),
    "run.outputs.exports": ("export_checkpoint", "export_recalibrated"),
    "settings": ("Settings", "get_settings"),
    "client": ("BnrecalClient",),
}
__getattr__, __all__ = lazy_exports(__name__, _HOMES)
