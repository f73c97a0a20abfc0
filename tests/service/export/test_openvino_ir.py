"""OpenVINO IR of an ONNX file (``service.export.openvino_ir``): made in the OpenVINO process,
run back against the ONNX file, written whole; a file OpenVINO cannot read is an error and
nothing is written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnrecal.errors import ExportError
from bnrecal.service.export.openvino_ir import make_openvino_ir

def scaled_relu() -> bytes:
    """y = relu(x * w + b) over 4 features, with a dynamic batch: written with onnx's helpers."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(4,)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(size=(4,)).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
         helper.make_node("Relu", ["a"], ["y"])],
        "scaled_relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], initializer=[w, b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def test_the_ir_computes_what_the_onnx_file_computes_and_is_written_whole(tmp_path):
    batches = [np.random.default_rng(1).normal(size=(n, 4)).astype(np.float32) for n in (1, 5)]
    made = make_openvino_ir(scaled_relu(), batches, int8=False)
    assert made.section.verified_batches == [1, 5] and made.section.max_abs_diff_to_onnxruntime <= 1e-6
    made.write(tmp_path / "m.xml")
    assert (tmp_path / "m.xml").read_bytes() == made.xml and (tmp_path / "m.bin").read_bytes() == made.bin
    assert len(made.bin) == made.section.bin_bytes == 32  # w and b, 4 float32 each: not compressed to FP16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin", "m.xml"]  # no scratch left beside


def test_a_file_openvino_cannot_read_is_an_error(tmp_path):
    with pytest.raises(ExportError, match="cannot be made OpenVINO IR"):
        make_openvino_ir(b"not an onnx file", [np.zeros((1, 4), np.float32)], int8=False)
