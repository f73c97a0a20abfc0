"""bnrecal from Python: recalibrate a live model's BatchNorm statistics, in place.

    import bnrecal

    report = bnrecal.recalibrate(model, loader, workers=2)   # like update_bn(loader, model)
    print(report)
    bnrecal.export_onnx(model, "model.onnx", sample)          # folded, verified ONNX
    bnrecal.quantize(model, "model-int8.onnx", calibration)   # folded, INT8 (QDQ), checked
    bnrecal.export_openvino(model, "model.xml", sample)       # OpenVINO IR (.xml, .bin), checked

See docs/python.md. This package is the public face and the one installed name: the
repository's folders install beneath it (``bnrecal.service``, ``bnrecal.workers``,
``bnrecal.api``). Public names are imported on first use, so ``import bnrecal`` (and a rank
process importing ``bnrecal.workers``) loads neither torch nor Ray until one is used.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING

from bnrecal import errors
from bnrecal.workers.lazy import lazy_exports

try:
    __version__ = metadata.version("bnrecal")
except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

_HOMES = {
    "service.client": ("BnrecalClient",),
    "service.jobserver.records.views": ("JobStatus", "JobView"),  # what the client's job calls return
    "service.live": ("CellResult", "RecalibrationReport", "export_onnx", "export_openvino", "quantize", "recalibrate",
                     "recalibrate_many"),
    "service.export.report_sections": ("Int8Section", "OnnxSection", "OpenVinoSection"),  # what the exports return
    "service.export.int8.options": ("Int8Options",),  # quantize's options, typed
    "service.run.options": ("RecalibrationOptions",),  # recalibrate's options, typed
    "errors": errors.__all__,  # the error tree, bnrecal.errors: every class it lists, by the same name
}
__getattr__, __all__ = lazy_exports(__name__, _HOMES)

if TYPE_CHECKING:  # what editors and type checkers see; at run time each name loads on first use
    from bnrecal.errors import *  # noqa: F403 - the names bnrecal.errors.__all__ lists
    from bnrecal.service.client import BnrecalClient
    from bnrecal.service.jobserver.records.views import JobStatus, JobView
    from bnrecal.service.export.int8.options import Int8Options
    from bnrecal.service.export.report_sections import Int8Section, OnnxSection, OpenVinoSection
    from bnrecal.service.run.options import RecalibrationOptions
    from bnrecal.service.live import (
        CellResult, RecalibrationReport, export_onnx, export_openvino, quantize, recalibrate, recalibrate_many,
    )
