"""The bnrecal service core: recalibration runs, folded ONNX export, jobs, blobs, settings,
the HTTP client and the CLI. The HTTP app itself lives in ``api`` (``api.create_app``).

Public names are imported on first use, so the CLI starts without loading torch or Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "recalibrate": ("Recalibration", "RecalibrationRequest", "recalibrate"),
    "exporting": ("export_checkpoint", "export_recalibrated"),
    "settings": ("Settings", "get_settings"),
    "client": ("BnrecalClient",),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'service' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
