"""The files a run exports beside the recalibrated model, in one table: each one's name (an
entry of a job spec's ``outputs`` and the artifact it gives), the file a single job and a
sweep's cell write, and what it is (docs/api.md, "Jobs"; docs/sweeps.md). Light to import:
the job spec's schema is built from it without loading torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bnrecal.errors import SpecError


@dataclass(frozen=True)
class ExportProduct:
    """One exported file: its ``name``, the file a job writes in its work folder
    (``job_file``) and a sweep's cell in its own (``cell_file``), whether the INT8 phase makes
    it (``int8``), and whether it is OpenVINO's IR (an ``.xml`` with its ``.bin`` beside,
    shipped over HTTP as one tar named ``download``). ``label`` is its short name (the web
    form's checkbox), ``description`` says what it is (the job spec's schema, the form),
    ``path_help`` what its flag on ``calibrate`` and ``submit`` does
    (the path to write it to) and ``cell_help`` what ``sweep``'s does (a file in every cell)."""

    name: str
    job_file: str
    cell_file: str
    int8: bool
    openvino_ir: bool
    label: str
    description: str
    path_help: str
    cell_help: str

    @property
    def flag(self) -> str:
        """Its command-line flag: ``--onnx-int8`` for ``onnx_int8``."""
        return "--" + self.name.replace("_", "-")

    def download(self, *, cell: bool) -> str | None:
        """The file name an IR's tar is downloaded as (a job's, or a cell's); None for an ONNX file
        (downloaded as it is)."""
        if not self.openvino_ir:
            return None
        stem = self.name.replace("_", "-")
        return f"{stem}.tar" if cell else f"recalibrated-{stem}.tar"


PRODUCTS = (
    ExportProduct("onnx", "recalibrated.onnx", "model.onnx", False, False,
                  "ONNX",
                  "the folded model in ONNX (FP32, or FP16 by onnx.dtype)",
                  "Also export the model folded to ONNX here.",
                  "Also export each cell's model folded to ONNX (model.onnx)."),
    ExportProduct("onnx_int8", "recalibrated-int8.onnx", "model.int8.onnx", True, False,
                  "ONNX INT8",
                  "the folded model in INT8 (QDQ ONNX)",
                  "Also export the folded model in INT8 (QDQ) here, ranges from the calibration data.",
                  "Also export each cell's model in INT8 QDQ (model.int8.onnx)."),
    ExportProduct("openvino", "openvino/model.xml", "model.xml", False, True,
                  "OpenVINO IR",
                  "OpenVINO IR of the FP32 model: a tar of model.xml and model.bin",
                  "Also write the folded FP32 model as OpenVINO IR here (PATH.xml, the .bin beside).",
                  "Also write each cell's folded FP32 model as OpenVINO IR (model.xml, model.bin)."),
    ExportProduct("openvino_int8", "openvino-int8/model.xml", "model.int8.xml", True, True,
                  "OpenVINO IR INT8",
                  "OpenVINO IR of the INT8 model: a tar of model.xml and model.bin",
                  "Also write the INT8 model as OpenVINO IR here (PATH.xml, the .bin beside).",
                  "Also write each cell's INT8 model as OpenVINO IR (model.int8.xml, model.int8.bin)."),
)

PRODUCT_NAMES = tuple(product.name for product in PRODUCTS)
"""Every exported file's name, in the order reports and listings give them."""


def products_of(names: Iterable[str] | None) -> tuple[ExportProduct, ...]:
    """The products among ``names`` (a job's ``outputs``: the model's name may be there too), in table order."""
    asked = set(names or ())
    return tuple(product for product in PRODUCTS if product.name in asked)


def product_named(name: str) -> ExportProduct:
    """The product called ``name`` (a ``KeyError`` for none: a name in the code, never a user's)."""
    return {product.name: product for product in PRODUCTS}[name]


def ir_xml_path(path: str | Path, field: str) -> Path:
    """An OpenVINO IR's ``.xml`` path (its ``.bin`` goes beside), refused otherwise before
    any work, naming ``field`` (a flag, or a Python argument)."""
    xml = Path(path)
    if xml.suffix != ".xml":
        raise SpecError(f"{field} names the IR's .xml file (its .bin goes beside): {xml}", field=field)
    return xml
