"""The INT8 export's options, declared once for the job spec, the command line and the Python API."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from bnrecal.errors import SpecError

Int8Method = Literal["minmax", "percentile", "entropy"]

DEFAULT_BINS = {"percentile": 2048, "entropy": 128}
"""Histogram bins by method: onnxruntime's defaults (``create_calibrator``)."""


class Int8Options(BaseModel):
    """How to quantize the folded export: onnxruntime's methods and meanings, weights int8
    symmetric (per output channel by default), activations with ranges from the
    calibration data."""

    model_config = ConfigDict(extra="forbid")

    method: Int8Method = Field(
        default="minmax",
        description="Activation ranges: minmax (min and max seen), percentile or entropy (onnxruntime's meanings).",
    )
    per_channel: StrictBool = Field(default=True, description="Weights quantized per output channel (else per tensor).")
    activation_type: Literal["uint8", "int8"] = Field(
        default="uint8", description="Activation type (uint8 runs fastest on x86 CPUs with VNNI)."
    )
    keep_float: list[str] = Field(
        default_factory=list, max_length=1000,
        description="Nodes (by name) or op types (e.g. Gemm) of the exported graph to leave in float.",
    )
    percentile: StrictFloat = Field(default=99.999, gt=0, le=100, description="Percentile kept by method percentile.")
    bins: StrictInt | None = Field(
        default=None, ge=128, le=65536,
        description="Histogram bins (percentile, entropy); default onnxruntime's: 2048 percentile, 128 entropy.",
    )
    quantized_bins: StrictInt = Field(default=128, ge=2, le=65536, description="Quantized bins (entropy).")
    max_top1_drop: StrictFloat | None = Field(
        default=None, ge=0, le=100,
        description="Largest top-1 drop (points) against the FP32 model on the evaluation data; "
        "the most sensitive ops are kept in float until it holds, else the job fails.",
    )
    max_float_ops: StrictInt | None = Field(
        default=None, ge=0, le=100_000,
        description="Most ops the max_top1_drop guard may keep in float (default: half of the quantized ops).",
    )

    def histogram_bins(self) -> int:
        """The histogram bins of a histogram method."""
        return self.bins if self.bins is not None else DEFAULT_BINS[self.method]

    @property
    def absolute(self) -> bool:
        """Whether the histogram is of absolute values: onnxruntime's percentile is
        symmetric by default (``create_calibrator``), its entropy is not."""
        return self.method == "percentile"


def int8_options(value: object, field: str = "int8") -> Int8Options:
    """``value`` (a dict, an ``Int8Options`` or None) validated, or a ``SpecError`` naming
    the field (``int8.method: ...``)."""
    if isinstance(value, Int8Options):
        return value
    try:
        return Int8Options.model_validate(value or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join([field, *(str(part) for part in first["loc"])])
        raise SpecError(f"{where}: {first['msg']}", field=where) from None
