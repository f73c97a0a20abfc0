"""onnxruntime latency of unfolded and BN-folded exports, in one run.

For torchvision resnet18 and mobilenet_v3_small (random weights, BN statistics
recalibrated on random 3x224x224 data), two files are exported through the same
pipeline: *unfolded* (exported and constant-folded, BatchNormalization nodes kept) and
*folded* (``export_folded_onnx``). Each is timed in onnxruntime on the CPU at batch 1
and 8, with graph optimizations disabled and enabled (``ORT_ENABLE_ALL``, which fuses
Conv + BN itself). The two files are run alternately; the medians of wall-clock time and
of process CPU time per run are printed as a markdown table (on a shared machine the CPU
time is the steadier of the two; with one intra-op thread both measure the same work).

    .venv/bin/python bench/onnx_latency.py [--repeats 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
import torchvision

from bnrecal.service.export import export_folded_onnx
from bnrecal.service.export.exporters import export_unfolded
from bnrecal.service.export.graph_passes import finalize, fold_constants

SHAPE = (3, 224, 224)
MODELS = ("resnet18", "mobilenet_v3_small")
BATCHES = (1, 8)
LEVELS = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "enabled": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}


def recalibrated(name: str) -> torch.nn.Module:
    """A torchvision model whose BN statistics come from a train-mode pass over random data."""
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.momentum = None
    model.train()
    with torch.no_grad():
        model(torch.randn(16, *SHAPE))
    return model.eval()


def export_unfolded_file(model: torch.nn.Module, samples: torch.Tensor, path: Path) -> None:
    """The same export pipeline without either BN fold."""
    raw = export_unfolded(model, samples[:2], opset=18, dynamic_batch=True, n_outputs=1)
    fold_constants(raw.model)
    finalize(raw.model)
    ir.save(raw.model, path)


def session(path: Path, level: str, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = LEVELS[level]
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def median_latencies(
    paths: list[Path], level: str, batch: int, threads: int, repeats: int
) -> list[tuple[float, float]]:
    """(wall, CPU) median milliseconds per run of each file, measured alternately after a warm-up."""
    sessions = [session(path, level, threads) for path in paths]
    feed = np.random.default_rng(0).standard_normal((batch, *SHAPE), dtype=np.float32)
    wall: list[list[float]] = [[] for _ in sessions]
    cpu: list[list[float]] = [[] for _ in sessions]
    for repeat in range(repeats + 3):
        for index, sess in enumerate(sessions):
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            sess.run(None, {sess.get_inputs()[0].name: feed})
            if repeat >= 3:
                wall[index].append((time.perf_counter() - wall_start) * 1000)
                cpu[index].append((time.process_time() - cpu_start) * 1000)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, cpu)]


def main() -> None:
    """Export both variants of each model, time them, print one markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            model = recalibrated(name)
            samples = torch.randn(8, *SHAPE)
            unfolded, folded = Path(tmp) / f"{name}-unfolded.onnx", Path(tmp) / f"{name}-folded.onnx"
            export_unfolded_file(model, samples, unfolded)
            report = export_folded_onnx(model, samples, folded)
            bn_before = sum(n.op_type == "BatchNormalization" for n in onnx.load(str(unfolded)).graph.node)
            for batch in BATCHES:
                for level in LEVELS:
                    before, after = median_latencies([unfolded, folded], level, batch, args.threads, args.repeats)
                    rows.append((name, batch, level, f"{bn_before} → {report['batchnorm_nodes']}", before, after))
    print(f"onnxruntime {ort.__version__}, CPU, {args.threads} intra-op thread(s), medians of {args.repeats} runs\n")
    print(
        "| model | batch | ORT graph optimizations | BN nodes | wall ms unfolded / folded | "
        "CPU ms unfolded / folded | CPU unfolded ÷ folded |"
    )
    print("|---|---:|---|---|---:|---:|---:|")
    for name, batch, level, bn, (wall0, cpu0), (wall1, cpu1) in rows:
        print(
            f"| {name} | {batch} | {level} | {bn} | {wall0:.1f} / {wall1:.1f} | {cpu0:.1f} / {cpu1:.1f} "
            f"| {cpu0 / cpu1:.2f}× |"
        )


if __name__ == "__main__":
    main()
