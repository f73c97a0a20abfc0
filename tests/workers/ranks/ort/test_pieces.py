"""A rank's onnxruntime runs in pieces (``workers.ranks.ort.pieces``): pieces even and never
a lone sample of several; outputs bound to reused buffers equal, value for value, what a
plain ``session.run`` of the whole slice returns (the input among them, two piece sizes);
a declared shape onnxruntime does not produce runs unbound, with the same values."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torchvision

import bnrecal.workers.ranks.ort.pieces as onnx_pieces
from bnrecal.workers.ranks.ort.rank_pass import calibration_session, with_outputs
from bnrecal.workers.ranks.ort.pieces import PieceRunner, piece_sizes

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.int8.quantizer import prepare
from bnrecal.service.run.outputs.int8 import range_request
from tests.service.export.int8_helpers import fp32_export


def test_pieces_are_even_and_never_one_sample_of_several():
    assert piece_sizes(16, 5) == [4, 4, 4, 4] and piece_sizes(17, 5) == [5, 4, 4, 4]
    assert piece_sizes(3, 2) == [3] and piece_sizes(16, 1) == [2] * 8  # a lone sample runs another Gemm kernel
    assert piece_sizes(1, 1) == [1] and piece_sizes(0, 4) == [] and piece_sizes(9, None) == [9]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A prepared resnet18 export with its calibrated tensors (the input among them) as
    outputs, and 9 samples: pieces of two sizes when a piece holds about two samples."""
    torch.manual_seed(5)
    samples = torch.randn(9, 3, 32, 32)
    path = tmp_path_factory.mktemp("pieces") / "fp32.onnx"
    prepared = prepare(fp32_export(torchvision.models.resnet18(num_classes=10), samples, path))
    tensors = list(range_request(prepared, Int8Options()).tensors)
    return prepared, tensors, samples.numpy()


def _by_piece(runner: PieceRunner, array: np.ndarray) -> list[np.ndarray]:
    """Every output over the whole array, the pieces' values copied out as they come."""
    pieces = [[output.copy() for output in outputs] for outputs in runner.pieces(array)]
    return [np.concatenate([piece[i] for piece in pieces]) for i in range(len(runner.names))]


def test_bound_pieces_give_a_plain_runs_values_into_reused_buffers(calibrated, monkeypatch):
    prepared, tensors, samples = calibrated
    session = calibration_session(with_outputs(prepared.model, tensors), 1)
    assert session.get_inputs()[0].name in tensors  # the input is calibrated too: it is not written to a buffer
    plain = session.run(tensors, {session.get_inputs()[0].name: samples})
    per_sample = sum(output.nbytes for output in plain) // len(samples)
    monkeypatch.setattr(onnx_pieces, "RUN_BYTES", 2 * per_sample)
    runner = PieceRunner(session, tensors)
    assert piece_sizes(len(samples), onnx_pieces.samples_per_run(session, tensors)) == [3, 2, 2, 2]
    for got, want in zip(_by_piece(runner, samples), plain, strict=True):
        assert np.array_equal(got, want)
    feed = tensors.index(session.get_inputs()[0].name)
    addresses = [[o.ctypes.data for i, o in enumerate(outputs) if i != feed] for outputs in runner.pieces(samples)]
    assert addresses[1] == addresses[2] == addresses[3] != addresses[0]  # pieces of one size write the same memory
    assert _by_piece(runner, samples[::-1].copy())[-1].tolist() == plain[-1][::-1].tolist()  # no stale piece


def test_a_declared_shape_onnxruntime_does_not_produce_runs_unbound_with_the_same_values(calibrated):
    """A graph declaring an output one row too many: onnxruntime reports that dimension
    unknown, so the outputs are not bound (a buffer of the declared shape would be read
    wrongly) and the pieces run plainly."""
    prepared, tensors, samples = calibrated
    model = onnx.load_from_string(with_outputs(prepared.model, tensors))
    wrong = next(output for output in model.graph.output
                 if output.name != model.graph.input[0].name and len(output.type.tensor_type.shape.dim) == 4)
    wrong.type.tensor_type.shape.dim[2].dim_value += 1
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    plain = session.run(tensors, {session.get_inputs()[0].name: samples})
    runner = PieceRunner(session, tensors)
    assert onnx_pieces.samples_per_run(session, tensors) is None  # whole slices, as before binding
    for got, want in zip(_by_piece(runner, samples), plain, strict=True):
        assert np.array_equal(got, want)
