"""What the INT8 range pass costs at each onnxruntime optimization level, and whether its
ranges stay exact.

The range pass (docs/int8.md) runs the prepared FP32 export with every tensor to calibrate
made a graph output, as onnxruntime's own calibrator does, and in a session with graph
optimizations off (``ORT_DISABLE_ALL``), as that calibrator makes it: ``minmax`` ranges at K = 1 equal the
calibrator's (docs/int8.md, "How the ranges are gathered"). This bench shows what that choice
costs and why it is kept: for a torchvision resnet18 (random weights) at 224, the same
augmented model is run at each level over the same random batches (one intra-op thread, as
a rank runs it; the first pass warms up) and each level's per-tensor minimum and maximum
are compared with the disabled level's, bit for bit. Two more rows keep optimizations off and
gather the same ranges otherwise: as a rank does (``workers/ranks/ort/pieces.py``: the
outputs bound to buffers reused from run to run, each reduced with one ``torch.aminmax``), and
as onnxruntime's ``MinMaxCalibrater`` augments the graph (a ``ReduceMin`` and a ``ReduceMax``
node per tensor, only their results returned). The last two rows run the model alone (no
tensor an output), with optimizations off and on.

    .venv/bin/python bench/range_session.py [--samples 32] [--batch 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torchvision

from bnrecal.service.export import export_folded_onnx
from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.int8.quantizer import prepare
from bnrecal.service.run.outputs.int8 import range_request
from bnrecal.workers.engine.ranges import MinMaxAccumulator
from bnrecal.workers.ranks.ort.rank_pass import calibration_session, with_outputs
from bnrecal.workers.ranks.ort.pieces import PieceRunner

LEVELS = {
    "disabled (the calibrator's)": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def ranges_at(model: bytes, level: ort.GraphOptimizationLevel, batches: list[np.ndarray]) -> tuple[float, dict]:
    """Milliseconds a sample, and each output's (min, max), of one session at ``level``."""
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for batch in batches:
        session.run(None, {name: batch})
    started = time.perf_counter()
    outputs = [session.run(None, {name: batch}) for batch in batches]
    seconds = time.perf_counter() - started
    names = [output.name for output in session.get_outputs()]
    ranges = {n: (min(o[i].min() for o in outputs), max(o[i].max() for o in outputs)) for i, n in enumerate(names)}
    return 1000.0 * seconds / sum(len(batch) for batch in batches), ranges


def ranges_bound(model: bytes, tensors: tuple[str, ...], batches: list[np.ndarray]) -> tuple[float, dict]:
    """Milliseconds a sample, and each tensor's (min, max), as a rank gathers them: outputs
    bound to reused buffers, in pieces, each reduced by the rank's accumulator."""
    session = calibration_session(with_outputs(model, tensors), threads=1)
    runner, ranges = PieceRunner(session, tensors), MinMaxAccumulator(tensors)

    def one_read() -> None:
        for batch in batches:
            for outputs in runner.pieces(batch):
                for index, values in enumerate(outputs):
                    ranges.add(index, values)

    one_read()  # warm-up (the same values again: the min and max do not change)
    started = time.perf_counter()
    one_read()
    seconds = time.perf_counter() - started
    found = {name: (ranges.low[i], ranges.high[i]) for i, name in enumerate(tensors)}
    return 1000.0 * seconds / sum(len(batch) for batch in batches), found


def with_reductions(model_bytes: bytes, tensors: tuple[str, ...]) -> tuple[bytes, dict[str, tuple[str, str]]]:
    """The model as onnxruntime's ``MinMaxCalibrater`` augments it: a ``ReduceMin`` and a
    ``ReduceMax`` (over every axis) of each tensor as the graph's outputs; their names by tensor."""
    import onnx

    model = onnx.load_from_string(model_bytes)
    del model.graph.output[:]
    names = {}
    for tensor in tensors:
        names[tensor] = (f"{tensor}_ReduceMin", f"{tensor}_ReduceMax")
        for op, out in zip(("ReduceMin", "ReduceMax"), names[tensor]):
            model.graph.node.append(onnx.helper.make_node(op, [tensor], [out], keepdims=1))
            model.graph.output.append(onnx.helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None))
    return model.SerializeToString(), names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    samples = torch.randn(args.samples, 3, 224, 224)
    with tempfile.TemporaryDirectory() as temp:
        path = Path(temp) / "fp32.onnx"
        export_folded_onnx(model, samples[:8], path)
        prepared = prepare(path.read_bytes())
    tensors = range_request(prepared, Int8Options()).tensors
    augmented = with_outputs(prepared.model, tensors)
    batches = [samples[i : i + args.batch].numpy() for i in range(0, args.samples, args.batch)]
    measured = {label: ranges_at(augmented, level, batches) for label, level in LEVELS.items()}
    exact = measured["disabled (the calibrator's)"][1]
    print(f"resnet18 at 224, {len(tensors)} tensors calibrated, {args.samples} samples in batches of {args.batch}")
    print("| optimization level | ms a sample | ranges not equal to the calibrator's |")
    print("|---|---:|---:|")
    for label, (ms, ranges) in measured.items():
        differing = sum(ranges[name] != exact[name] for name in tensors)
        print(f"| {label} | {ms:.1f} | {differing} of {len(tensors)} |")
    ms, ranges = ranges_bound(prepared.model, tensors, batches)
    differing = sum((float(ranges[n][0]), float(ranges[n][1])) != tuple(map(float, exact[n])) for n in tensors)
    print(f"| disabled, outputs bound and reduced as a rank does | {ms:.1f} | {differing} of {len(tensors)} |")
    reduced, names = with_reductions(prepared.model, tensors)
    ms, ranges = ranges_at(reduced, LEVELS["disabled (the calibrator's)"], batches)
    differing = sum((ranges[names[n][0]][0], ranges[names[n][1]][1]) != exact[n] for n in tensors)
    print(f"| disabled, ReduceMin/ReduceMax in the graph (the calibrator's augmentation) | {ms:.1f} | "
          f"{differing} of {len(tensors)} |")
    for label in ("disabled (the calibrator's)", "all"):  # what the outputs cost, and what the level does
        plain_ms, _ = ranges_at(prepared.model, LEVELS[label], batches)
        print(f"| {label}, the model alone (no tensor an output, as a pass that only scores) | {plain_ms:.1f} | |")


if __name__ == "__main__":
    main()
