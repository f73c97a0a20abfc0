"""The INT8 export's options, declared once for the job spec, the command line and the Python API."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, model_validator

from bnrecal.errors import SpecError

Int8Method = Literal["minmax", "percentile", "entropy"]
Int8Target = Literal["onnxruntime", "tensorrt", "openvino"]
ActivationType = Literal["uint8", "int8", "uint16", "int16"]

DEFAULT_BINS = {"percentile": 2048, "entropy": 2048}
"""Histogram bins by method. ``percentile``: onnxruntime's default. ``entropy``: 2048, with 128
quantized bins, TensorRT's entropy calibrator's and the literature's choice (Migacz, "8-bit
Inference with TensorRT", 2017); onnxruntime's own default of 128 bins leaves the KL search
one candidate, the whole range, so it writes exactly the minmax file (docs/int8.md)."""

CPU_TARGETS = ("onnxruntime", "openvino")
"""The targets deployed on CPUs, whose files keep 7-bit weights by default (docs/int8.md, "Every x86 CPU")."""

DEFAULT_ACTIVATION = {"onnxruntime": "uint8", "tensorrt": "int8", "openvino": "uint8"}
"""Activation type by target: TensorRT takes int8 with zero point 0 only."""


class Int8Options(BaseModel):
    """How to quantize the folded export: onnxruntime's methods and meanings, weights int8
    symmetric (per output channel by default), activations with ranges from the
    calibration data, Q/DQ placed for the ``target`` runtime (docs/int8.md, "Targets: `int8.target`")."""

    model_config = ConfigDict(extra="forbid")

    target: Int8Target = Field(
        default="onnxruntime",
        description="The runtime the file is for: onnxruntime (QDQ on every op onnxruntime quantizes), "
        "tensorrt (int8 symmetric activations, zero point 0, QDQ on the inputs of TensorRT's quantizable ops), "
        "openvino (QDQ on the inputs of the ops NNCF quantizes for OpenVINO).",
    )
    method: Int8Method = Field(
        default="minmax",
        description="Activation ranges: minmax (min and max seen), percentile or entropy (onnxruntime's meanings).",
    )
    per_channel: StrictBool = Field(default=True, description="Weights quantized per output channel (else per tensor).")
    activation_type: ActivationType | None = Field(
        default=None,
        description="Activation type; default by target: uint8 (onnxruntime, openvino), int8 (tensorrt). "
        "16-bit types are for target onnxruntime only.",
    )
    symmetric_activations: StrictBool | None = Field(
        default=None,
        description="Activation ranges made symmetric around 0 (zero point 0 for int8); default: true for "
        "tensorrt, which requires it, false otherwise.",
    )
    reduce_range: StrictBool | None = Field(
        default=None,
        description="Weights in 7 bits, -64..64 (onnxruntime's reduce_range), which no x86 CPU's 8-bit kernels can "
        "saturate; default: true for the CPU targets (onnxruntime, openvino), false for tensorrt. false writes full "
        "8-bit weights, for deployments known to have VNNI (avx512_vnni, avx_vnni, amx_int8).",
    )
    op_types: list[str] | None = Field(
        default=None, max_length=1000,
        description="Only these op types are quantized (an allowlist, onnxruntime's op_types_to_quantize); "
        "default: the target's quantizable ops.",
    )
    keep_float: list[str] = Field(
        default_factory=list, max_length=1000,
        description="Nodes (by name) or op types (e.g. Gemm) of the exported graph to leave in float.",
    )
    percentile: StrictFloat = Field(default=99.999, gt=0, le=100, description="Percentile kept by method percentile.")
    bins: StrictInt | None = Field(
        default=None, ge=128, le=65536,
        description="Histogram bins (percentile, entropy); default 2048 for both.",
    )
    quantized_bins: StrictInt = Field(default=128, ge=2, le=65536, description="Quantized bins (entropy).")
    max_top1_drop: StrictFloat | None = Field(
        default=None, ge=0, le=100,
        description="Largest top-1 drop (points) against the FP32 model on the evaluation data's report part; "
        "the most sensitive ops (ranked on its selection part) are kept in float until it holds, else no INT8 file.",
    )
    max_float_ops: StrictInt | None = Field(
        default=None, ge=0, le=100_000,
        description="Most ops the max_top1_drop guard may keep in float (default: half of the quantized ops).",
    )
    guard_selection: StrictFloat = Field(
        default=0.5, gt=0, lt=1,
        description="Share of the evaluation data the guard ranks and chooses float ops on; the rest reports "
        "the accuracies (without labelled calibration data).",
    )

    @model_validator(mode="after")
    def _fits_target(self) -> Int8Options:
        if self.target == "tensorrt":
            if self.activation_type not in (None, "int8"):
                raise ValueError("activation_type: target tensorrt takes int8 activations (zero point 0) only")
            if self.symmetric_activations is False:
                raise ValueError("symmetric_activations: target tensorrt takes symmetric activations only")
        if self.activation_type in ("uint16", "int16") and self.target != "onnxruntime":
            raise ValueError(f"activation_type: 16-bit activations are for target onnxruntime, not {self.target}")
        if self.method == "entropy" and self.quantized_bins > self.histogram_bins():
            raise ValueError("quantized_bins: more quantized bins than histogram bins")
        return self

    def histogram_bins(self) -> int:
        """The histogram bins of a histogram method."""
        return self.bins if self.bins is not None else DEFAULT_BINS.get(self.method, 2048)

    def activation(self) -> str:
        """The activation type, resolved for the target."""
        return self.activation_type or DEFAULT_ACTIVATION[self.target]

    def weights_reduced(self) -> bool:
        """Whether the weights are written in 7 bits (``reduce_range``), resolved for the target."""
        if self.reduce_range is not None:
            return self.reduce_range
        return self.target in CPU_TARGETS

    def weights_why(self) -> str:
        """Why the weights have the bits they have, for the report (docs/int8.md, "Every x86 CPU")."""
        if self.reduce_range is None:
            if self.target in CPU_TARGETS:
                return (f"7-bit weights, the default for target {self.target}: x86 CPUs without VNNI add u8 x s8 "
                        "products in pairs in 16 bits (VPMADDUBSW), which 8-bit weights can saturate and 7-bit "
                        "weights cannot")
            return f"8-bit weights, the default for target {self.target}: its GPUs' INT8 kernels accumulate in 32 bits"
        if self.reduce_range:
            return "7-bit weights, as asked (int8.reduce_range true): no x86 CPU's 8-bit kernels can saturate them"
        return ("8-bit weights, as asked (int8.reduce_range false): for CPUs with VNNI; on x86 CPUs without it "
                "onnxruntime's and OpenVINO's 8-bit kernels may saturate")

    def activations_symmetric(self) -> bool:
        """Whether activation ranges are made symmetric (zero point 0 for signed types)."""
        if self.symmetric_activations is not None:
            return self.symmetric_activations
        return self.target == "tensorrt"

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
        loc = [str(part) for part in first["loc"]]
        message = str(first["msg"]).removeprefix("Value error, ")
        if not loc and ":" in message:  # a cross-field rule names its field first
            name, message = message.split(":", 1)
            loc, message = [name], message.strip()
        where = ".".join([field, *loc])
        raise SpecError(f"{where}: {message}", field=where) from None
