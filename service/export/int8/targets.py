"""Where the Q/DQ pairs go and how they are typed, per target runtime (docs/int8.md, "Targets: `int8.target`").

onnxruntime's ``QDQQuantizer`` writes every file; a target only chooses its arguments:

- ``onnxruntime``: ``quantize_static``'s defaults: every op type its registries quantize,
  Q/DQ on their inputs and outputs, uint8 activations, int8 per-channel weights, int32 bias.
- ``tensorrt``: TensorRT's explicit quantization ("Working with Quantized Types", Q/DQ
  placement recommendations): Q/DQ on the *inputs* of the ops TensorRT runs in INT8
  (convolutions, GEMMs, pooling, and both inputs of an ``Add``, the residual included, so
  TensorRT fuses the add into the convolution before it), none on outputs (TensorRT moves
  them itself); activations int8 symmetric (zero point 0: TensorRT takes no other), weights
  int8 symmetric per channel, biases left float (TensorRT has no int32 DequantizeLinear).
- ``openvino``: the placement NNCF (OpenVINO's quantizer) uses for its ONNX backend: Q/DQ
  on the inputs of the ops it marks input-quantizable (convolutions, GEMMs, pooling,
  elementwise Add/Mul...), uint8 activations (the CPU plugin's u8 x s8 path), int8
  symmetric per-channel weights, biases left float.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from bnrecal.service.export.int8.options import Int8Options

TENSORRT_OPS = (
    "Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "AveragePool", "GlobalAveragePool", "MaxPool",
)
"""Ops whose inputs carry Q/DQ in a ``tensorrt`` file: the weighted ops, pooling, and Add
(TensorRT's residual fusion). Every other op runs as TensorRT chooses, from float."""

OPENVINO_OPS = (
    "Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Mul", "AveragePool", "GlobalAveragePool", "Resize",
)
"""NNCF's ONNX input-quantizable ops (``INPUTS_QUANTIZABLE_OPERATIONS``) that appear in the
folded exports: Q/DQ on their inputs in an ``openvino`` file."""

TENSORRT_QDQ_INPUT_TYPES = ("int8",)
"""The integer types TensorRT's ONNX parser reads in an INT8 file's Q/DQ (besides fp8/int4)."""


def _option(onnxruntime_name: str) -> Any:
    """A field of :class:`ExtraOptions`: None (onnxruntime's default) unless set, and the key
    onnxruntime reads it under."""
    return field(default=None, metadata={"onnxruntime": onnxruntime_name})


@dataclass(frozen=True)
class ExtraOptions:
    """The ``extra_options`` of onnxruntime's quantizer that bnrecal sets; None leaves one to
    onnxruntime's default."""

    output_float_ops: tuple[str, ...] | None = _option("OpTypesToExcludeOutputQuantization")
    quantize_bias: bool | None = _option("QuantizeBias")
    weight_symmetric: bool | None = _option("WeightSymmetric")
    activation_symmetric: bool | None = _option("ActivationSymmetric")
    use_qdq_contrib_ops: bool | None = _option("UseQDQContribOps")

    def onnxruntime(self) -> dict[str, Any]:
        """The ``extra_options`` dict onnxruntime takes: every option set, under its name."""
        options = {f.metadata["onnxruntime"]: getattr(self, f.name) for f in fields(self)}
        return {name: list(value) if isinstance(value, tuple) else value
                for name, value in options.items() if value is not None}


@dataclass(frozen=True)
class Placement:
    """The quantizer's arguments for a target: op types, which of them keep their output
    unquantized, and onnxruntime's ``extra_options``."""

    op_types: list[str]
    extra_options: ExtraOptions


def placement(options: Int8Options, quantizable: list[str], opset: int) -> Placement:
    """The op types to quantize and the extra options for ``options.target`` (and the
    user's allowlist, ``op_types``)."""
    if options.target == "tensorrt":
        op_types = list(TENSORRT_OPS)
    elif options.target == "openvino":
        op_types = list(OPENVINO_OPS)
    else:
        op_types = list(quantizable)
    if options.op_types is not None:
        op_types = [op for op in options.op_types]
    inputs_only = options.target != "onnxruntime"  # Q/DQ on inputs only, biases float, weights symmetric
    extra = ExtraOptions(
        output_float_ops=tuple(op_types) if inputs_only else None,
        quantize_bias=False if inputs_only else None,
        weight_symmetric=True if inputs_only else None,
        activation_symmetric=True if options.activations_symmetric() else None,
        # 16-bit Q/DQ before opset 21 live in onnxruntime's domain
        use_qdq_contrib_ops=True if options.activation() in ("uint16", "int16") and opset < 21 else None,
    )
    return Placement(op_types, extra)
