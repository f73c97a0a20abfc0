"""``int8.target``: the file follows the target runtime's published rules for QDQ models.

TensorRT cannot run here, so a ``tensorrt`` file is held to TensorRT's rules for explicit
quantization by reading the graph: int8 Q/DQ with zero point 0 everywhere (symmetric), no
int32 (bias) DequantizeLinear, Q/DQ only on the inputs of the ops TensorRT quantizes,
residual adds included, opset >= 13. Every target's file also runs in onnxruntime and
OpenVINO (``check_int8``)."""

from __future__ import annotations

import onnx
import pytest
import torch
import torchvision
from onnx import numpy_helper

from bnrecal.errors import SpecError

from bnrecal.service.export.int8.options import int8_options
from bnrecal.service.export.int8.targets import OPENVINO_OPS, TENSORRT_OPS
from bnrecal.service.run.int8 import quantize_export
from bnrecal.service.run.onnx_passes import InProcessPasses
from tests.service.export.int8_helpers import array_dataset, fp32_export


@pytest.fixture(scope="module")
def resnet(tmp_path_factory: pytest.TempPathFactory):
    """A torchvision resnet18 (residual adds) at 32x32, its FP32 export and 32 samples."""
    torch.manual_seed(0)
    tmp = tmp_path_factory.mktemp("targets")
    samples = torch.randn(32, 3, 32, 32)
    fp32 = fp32_export(torchvision.models.resnet18(num_classes=10), samples, tmp / "fp32.onnx")
    return fp32, samples, array_dataset(tmp / "x.npy", samples)


def quantized(resnet, options: dict):
    fp32, samples, dataset = resnet
    return quantize_export(fp32, int8_options(options), InProcessPasses(dataset, 16), samples)


def qdq_facts(model: bytes):
    graph = onnx.load_from_string(model).graph
    inits = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return graph, inits, producer, consumers


def test_tensorrt_file_follows_tensorrts_explicit_quantization_rules(resnet):
    result = quantized(resnet, {"target": "tensorrt"})
    graph, inits, producer, consumers = qdq_facts(result.model)
    assert onnx.load_from_string(result.model).opset_import[0].version >= 13
    qdq = [node for node in graph.node if node.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert qdq
    for node in qdq:
        zero_point = inits[node.input[2]]
        assert str(zero_point.dtype) == "int8" and not zero_point.any(), node.name  # symmetric, zero point 0
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            assert str(inits[node.input[0]].dtype) == "int8", node.name  # no int32 bias
    for node in graph.node:  # Q/DQ feed only the ops TensorRT quantizes (and Shape, which reads no values)
        if node.op_type == "DequantizeLinear":
            assert all(c.op_type in (*TENSORRT_OPS, "Shape") for c in consumers.get(node.output[0], [])), node.name
        if node.op_type == "QuantizeLinear":
            assert [c.op_type for c in consumers[node.output[0]]] == ["DequantizeLinear"], node.name
    adds = [node for node in graph.node if node.op_type == "Add"]
    assert len(adds) == 8  # resnet18's residual adds: both inputs quantized
    for node in [*adds, *(n for n in graph.node if n.op_type in ("Conv", "Gemm"))]:
        assert all(producer[name].op_type == "DequantizeLinear" for name in node.input[:2]), node.name
    section = result.section
    assert section["target"] == "tensorrt" and section["activation_type"] == "int8"
    assert section["symmetric_activations"] is True and section["runtimes"]["openvino"]["ran"]


def test_openvino_file_places_qdq_on_the_inputs_nncf_quantizes(resnet):
    result = quantized(resnet, {"target": "openvino"})
    graph, inits, producer, consumers = qdq_facts(result.model)
    for node in graph.node:
        if node.op_type == "DequantizeLinear":
            assert all(c.op_type in (*OPENVINO_OPS, "Shape") for c in consumers.get(node.output[0], [])), node.name
            if node.input[0] not in inits:
                assert producer[node.input[0]].op_type == "QuantizeLinear"
    activation_zero_points = [inits[n.input[2]] for n in graph.node if n.op_type == "QuantizeLinear"]
    assert activation_zero_points and all(str(z.dtype) == "uint8" for z in activation_zero_points)
    assert result.section["runtimes"]["openvino"]["ran"] and result.section["ops_quantized"]["Conv"] == 20


def test_onnxruntime_target_keeps_asymmetric_uint8_activations(resnet):
    graph, inits, _, _ = qdq_facts(quantized(resnet, {}).model)
    zero_points = [inits[n.input[2]] for n in graph.node if n.op_type == "QuantizeLinear"]
    assert all(str(z.dtype) == "uint8" for z in zero_points) and any(z.any() for z in zero_points)


def test_reduce_range_writes_7_bit_weights_and_op_types_is_an_allowlist(resnet):
    graph, inits, _, _ = qdq_facts(quantized(resnet, {"reduce_range": True}).model)
    weights = [inits[n.input[0]] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
               and str(inits[n.input[0]].dtype) == "int8"]
    assert weights and all(w.min() >= -64 and w.max() <= 64 for w in weights)  # onnxruntime's 7-bit symmetric range
    assert max(int(abs(w.astype(int)).max()) for w in weights) == 64  # the range is used
    section = quantized(resnet, {"op_types": ["Conv"]}).section
    assert set(section["ops_quantized"]) == {"Conv"} and section["op_types"] == ["Conv"]
    assert any(op["op_type"] == "Gemm" and op["reason"] == "not in int8.op_types" for op in section["ops_float"])


def test_16_bit_activations_for_onnxruntime(resnet):
    result = quantized(resnet, {"activation_type": "uint16"})
    graph, inits, _, _ = qdq_facts(result.model)
    assert {str(inits[n.input[2]].dtype) for n in graph.node if n.op_type == "QuantizeLinear"} == {"uint16"}
    section = result.section
    eight_bit = quantized(resnet, {}).section
    assert section["activation_type"] == "uint16" and section["max_abs_diff"] < eight_bit["max_abs_diff"]  # weights stay int8
    openvino = section["runtimes"]["openvino"]  # opset 18: onnxruntime's own 16-bit Q/DQ, which OpenVINO cannot read
    assert openvino["ran"] is False and "com.microsoft" in openvino["reason"]


@pytest.mark.parametrize(
    ("value", "field"),
    [({"target": "tensorrt", "activation_type": "uint8"}, "int8.activation_type"),
     ({"target": "tensorrt", "symmetric_activations": False}, "int8.symmetric_activations"),
     ({"target": "openvino", "activation_type": "int16"}, "int8.activation_type"),
     ({"target": "coreml"}, "int8.target")],
)
def test_options_a_target_cannot_take_are_refused_naming_the_field(value, field):
    with pytest.raises(SpecError) as caught:
        int8_options(value)
    assert caught.value.field == field and str(caught.value).startswith(field)
