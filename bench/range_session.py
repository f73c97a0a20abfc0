"""What the INT8 range pass costs at each onnxruntime optimization level, and whether its
ranges stay exact.

The range pass (docs/int8.md) runs the prepared FP32 export with every tensor to calibrate
made a graph output, as onnxruntime's own calibrator does, and in a session with graph
optimizations off (``ORT_DISABLE_ALL``), as that calibrator makes it: ``minmax`` ranges at K = 1 equal the
calibrator's (docs/int8.md, "How the ranges are gathered"). This bench shows what that choice
costs and why it is kept: for a torchvision resnet18 (random weights) at 224, the same
augmented model is run at each level over the same random batches (one intra-op thread, as
a rank runs it; the first pass warms up) and each level's per-tensor minimum and maximum
are compared with the disabled level's, bit for bit. The last two rows run the model alone
(no tensor an output), with optimizations off and on.

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
from bnrecal.service.run.int8 import range_request
from bnrecal.workers.ranks.onnx_pass import with_outputs

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
    for label in ("disabled (the calibrator's)", "all"):  # what the outputs cost, and what the level does
        plain_ms, _ = ranges_at(prepared.model, LEVELS[label], batches)
        print(f"| {label}, the model alone (no tensor an output, as a pass that only scores) | {plain_ms:.1f} | |")


if __name__ == "__main__":
    main()
