"""OpenVINO's own files of an exported model, ``model.xml`` and ``model.bin`` (docs/onnx.md,
"OpenVINO IR"): what OpenVINO deployers load directly, without reading ONNX at start-up.

They are made from a file that already passed its checks (the verified FP32 export, or the
checked INT8 file) by OpenVINO itself, in this process's OpenVINO process (never loaded into
a torch or Ray process: ``openvino_process``), weights kept in float32 (no FP16 compression:
the file must compute what the ONNX file computes). Then the IR is read back and run on the
verified batches beside the ONNX file, in OpenVINO and in onnxruntime (graph as written):

- the IR against the same ONNX file in OpenVINO: within ``1e-4 * max(1, max|y|)``, for FP32
  and INT8 alike (the conversion changes nothing the plugin computes);
- the FP32 IR against onnxruntime: within the same bound (the ONNX file's own OpenVINO check);
  the INT8 IR's difference from onnxruntime is reported, its arithmetic having been judged by
  the INT8 checks (docs/int8.md).

A file that fails either is an ``ExportError`` and nothing is written.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bnrecal.errors import ExportError, first_line
from bnrecal.workers.files import atomic_write

from bnrecal.service.export.report_sections import OpenVinoSection
from bnrecal.service.export.runtimes import largest_difference, openvino_version, saved_outputs

TOLERANCE = 1e-4
"""The IR's largest difference allowed, as a share of ``max(1, max|y|)`` (see above)."""


@dataclass(frozen=True)
class OpenVinoIr:
    """OpenVINO's two files of a model, checked, and the report section saying how."""

    xml: bytes
    bin: bytes
    section: OpenVinoSection

    def write(self, xml_path: Path) -> None:
        """Write ``xml_path`` and the ``.bin`` beside it (the name OpenVINO looks for), each
        whole or not at all: the weights first, so a reader of the ``.xml`` finds its ``.bin``."""
        atomic_write(xml_path.with_suffix(".bin"), lambda scratch: scratch.write_bytes(self.bin))
        atomic_write(xml_path, lambda scratch: scratch.write_bytes(self.xml))


def make_openvino_ir(model: bytes, batches: Sequence[np.ndarray], *, int8: bool) -> OpenVinoIr:
    """OpenVINO's files of the ONNX ``model`` (serialized), checked on ``batches`` (float32,
    the model's input) as the module says. Raises ``ExportError`` (one line) when OpenVINO is
    not installed, cannot convert or run the model, or the IR departs from the ONNX file."""
    from bnrecal.service.export.openvino_process import PROCESS
    from bnrecal.service.export.verification import onnx_outputs

    version = openvino_version()
    if version is None:
        raise ExportError("OpenVINO IR needs OpenVINO: pip install 'bnrecal[openvino]'")
    what = "the INT8 model" if int8 else "the model"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bnrecal-openvino-ir-") as scratch:
        folder = Path(scratch)
        (folder / "model.onnx").write_bytes(model)
        np.savez(folder / "batches.npz", **{f"b{b}": batch for b, batch in enumerate(batches)})
        try:
            PROCESS.run(folder, convert=True)
        except RuntimeError as exc:
            raise ExportError(f"{what} cannot be made OpenVINO IR: {first_line(exc)}; no file written") from exc
        ir_outputs = saved_outputs(folder / "outputs.npz", len(batches))
        as_onnx = saved_outputs(folder / "onnx_outputs.npz", len(batches))
        xml, weights = (folder / "model.xml").read_bytes(), (folder / "model.bin").read_bytes()
    try:
        reference = onnx_outputs(model, batches)
        to_onnx, scale = largest_difference(ir_outputs, as_onnx)
        to_onnxruntime, _ = largest_difference(ir_outputs, reference)
    except (ValueError, ExportError) as exc:
        raise ExportError(f"{what}'s OpenVINO IR {first_line(exc)}; no file written") from exc
    allowed = TOLERANCE * max(1.0, scale)
    for diff, against in ((to_onnx, "the ONNX file in OpenVINO"), (to_onnxruntime if not int8 else 0.0, "onnxruntime")):
        if not diff <= allowed:
            raise ExportError(f"{what}'s OpenVINO IR differs from {against} by {diff:.3g} (allowed {allowed:.3g}); "
                              "no file written")
    section = OpenVinoSection(
        made_from="the checked INT8 ONNX file" if int8 else "the verified FP32 ONNX export", version=version,
        xml_bytes=len(xml), bin_bytes=len(weights), verified_batches=[len(batch) for batch in batches],
        outputs_max_abs=scale, max_abs_diff_to_onnxruntime=to_onnxruntime, max_abs_diff_to_onnx_in_openvino=to_onnx,
        seconds=round(time.monotonic() - started, 3),
    )
    return OpenVinoIr(xml, weights, section)

