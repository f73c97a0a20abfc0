"""``int8.target``: the file follows the target runtime's published rules for QDQ models.

TensorRT cannot run here, so a ``tensorrt`` file is held to TensorRT's rules for explicit
quantization by reading the graph: int8 Q/DQ with zero point 0 everywhere (symmetric), no
int32 (bias) DequantizeLinear, Q/DQ only on the inputs of the ops TensorRT quantizes,
residual adds included, opset >= 13. Every target's file also runs in onnxruntime and
OpenVINO (``check_int8``)."""

from __future__ import annotations

import json

import onnx
import pytest
import torch
import torchvision
from onnx import numpy_helper

from bnrecal.errors import SpecError

from bnrecal.service.export.int8.options import int8_options
from bnrecal.service.export.int8.targets import OPENVINO_OPS, TENSORRT_OPS
from bnrecal.service.run.outputs.int8 import quantize_export
from bnrecal.service.run.outputs.onnx_passes import InProcessPasses
from tests.service.export.int8_helpers import array_dataset, fp32_export


@pytest.fixture(scope="module")
def resnet(tmp_path_factory: pytest.TempPathFactory):
    """A torchvision resnet18 (residual adds) at 32x32, its FP32 export and 32 samples."""
    torch.manual_seed(0)
    tmp = tmp_path_factory.mktemp("targets")
    samples = torch.randn(32, 3, 32, 32)
    fp32 = fp32_export(torchvision.models.resnet18(num_classes=10), samples, tmp / "fp32.onnx")
    return fp32, samples, array_dataset(tmp / "x.npy", samples)


@pytest.fixture(scope="module")
def files() -> dict:
    """The module's INT8 exports by their options: the same options' file (the default's,
    tensorrt's, openvino's) is made once for all the tests that read it."""
    return {}


def quantized(resnet, files: dict, options: dict):
    key = json.dumps(options, sort_keys=True)
    if key not in files:
        fp32, samples, dataset = resnet
        files[key] = quantize_export(fp32, int8_options(options), InProcessPasses(dataset, 16), samples)
    return files[key]


def qdq_facts(model: bytes):
    graph = onnx.load_from_string(model).graph
    inits = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return graph, inits, producer, consumers


def test_tensorrt_file_follows_tensorrts_explicit_quantization_rules(resnet, files):
    result = quantized(resnet, files, {"target": "tensorrt"})
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


def test_openvino_file_places_qdq_on_the_inputs_nncf_quantizes(resnet, files):
    result = quantized(resnet, files, {"target": "openvino"})
    graph, inits, producer, consumers = qdq_facts(result.model)
    for node in graph.node:
        if node.op_type == "DequantizeLinear":
            assert all(c.op_type in (*OPENVINO_OPS, "Shape") for c in consumers.get(node.output[0], [])), node.name
            if node.input[0] not in inits:
                assert producer[node.input[0]].op_type == "QuantizeLinear"
    activation_zero_points = [inits[n.input[2]] for n in graph.node if n.op_type == "QuantizeLinear"]
    assert activation_zero_points and all(str(z.dtype) == "uint8" for z in activation_zero_points)
    assert result.section["runtimes"]["openvino"]["ran"] and result.section["ops_quantized"]["Conv"] == 20


def test_onnxruntime_target_keeps_asymmetric_uint8_activations(resnet, files):
    graph, inits, _, _ = qdq_facts(quantized(resnet, files, {}).model)
    zero_points = [inits[n.input[2]] for n in graph.node if n.op_type == "QuantizeLinear"]
    assert all(str(z.dtype) == "uint8" for z in zero_points) and any(z.any() for z in zero_points)


def largest_weight(model: bytes) -> int:
    """The largest |q| of the file's int8 weights (the initializers its DequantizeLinear read)."""
    graph, inits, _, _ = qdq_facts(model)
    weights = [inits[n.input[0]] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
               and str(inits[n.input[0]].dtype) == "int8"]
    assert weights
    return max(int(abs(w.astype(int)).max()) for w in weights)


@pytest.mark.parametrize("asked, bits, why", [
    ({}, 7, "the default for target onnxruntime"),
    ({"target": "openvino"}, 7, "the default for target openvino"),
    ({"target": "tensorrt"}, 8, "the default for target tensorrt"),
    ({"reduce_range": False}, 8, "as asked (int8.reduce_range false)"),
    ({"target": "tensorrt", "reduce_range": True}, 7, "as asked (int8.reduce_range true)"),
])
def test_cpu_targets_write_7_bit_weights_unless_asked_for_8(resnet, files, asked, bits, why):
    """7-bit weights (onnxruntime's reduce_range: -64..64) cannot saturate the 16-bit pair sums
    of x86 CPUs without VNNI, so the CPU targets write them by default; ``reduce_range: false``
    keeps full 8-bit weights (-127..127) for deployments known to have VNNI; TensorRT's GPUs
    accumulate in 32 bits and keep 8 (docs/int8.md, "Every x86 CPU")."""
    result = quantized(resnet, files, asked)
    assert largest_weight(result.model) == (64 if bits == 7 else 127)  # the whole range is used
    section = result.section
    assert section["reduce_range"] is (bits == 7)
    assert section["weights"].endswith(", 7-bit (reduce_range)" if bits == 7 else ", 8-bit")
    assert section["weights_why"].startswith(f"{bits}-bit weights, {why}")


def test_op_types_is_an_allowlist(resnet, files):
    section = quantized(resnet, files, {"op_types": ["Conv"]}).section
    assert set(section["ops_quantized"]) == {"Conv"} and section["op_types"] == ["Conv"]
    assert any(op["op_type"] == "Gemm" and op["reason"] == "not in int8.op_types" for op in section["ops_float"])


def test_16_bit_activations_for_onnxruntime(resnet, files):
    result = quantized(resnet, files, {"activation_type": "uint16"})
    graph, inits, _, _ = qdq_facts(result.model)
    assert {str(inits[n.input[2]].dtype) for n in graph.node if n.op_type == "QuantizeLinear"} == {"uint16"}
    section = result.section
    eight_bit = quantized(resnet, files, {}).section
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
