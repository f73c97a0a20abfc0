"""How many samples the statistics need: top-1 and cross-entropy against the number of
calibration samples, drawn in path order (class by class, as class folders are read) or in
the seeded fair order, and where ``max_samples: "auto"`` stops at each tolerance.

The digits value case (``service/demo.py``): a torchvision resnet18 trained on scikit-learn's
real handwritten digits, whose BN statistics are stale after a camera change; its
calibration data (1437 scans through the new camera) is written in label order, as an
image folder with class folders is read, and evaluated on the 360 held-out scans. The
statistics run through the product's own readers (``describe_dataset`` with ``order``) and
engine (``calibration_pass``, one process, sync mode, batch 32). Fair-order rows are the
mean (and spread) over 5 seeds.

    PYTHONPATH=. .venv/bin/python bench/sample_count.py [--work DIR]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torchvision

from bnrecal.service import demo
from bnrecal.workers.data import ReadOptions, describe_dataset, iter_batches
from bnrecal.workers.engine.batchnorm import find_batchnorm_layers
from bnrecal.workers.engine.statistics_pass import MIN_STEPS, StopRule, apply_statistics, calibration_pass
from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.workers.ranks.sharding import step_ranges

BATCH = 32
COUNTS = (64, 128, 300, 600, 1437)
SEEDS = range(5)
TOLERANCES = (0.2, 0.1, 0.05)  # below 0.05 the 1437 scans run out first


def prepare(work: Path) -> tuple[torch.nn.Module, Path, torch.Tensor, torch.Tensor]:
    """The stale model, the class-ordered calibration file and the held-out set (trained once)."""
    checkpoint, calib = work / "resnet18-stale.pt", work / "calib-by-class.npy"
    digits = demo.load_digits_split(0)
    if not checkpoint.exists():
        started = time.perf_counter()
        demo.write_demo_inputs(work)
        print(f"(trained the demo's resnet18 in {time.perf_counter() - started:.0f} s)")
    order = np.argsort(digits.train_y.numpy(), kind="stable")
    np.save(calib, digits.new_train_x.numpy()[order])
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    return model.eval(), calib, digits.new_eval_x, digits.eval_y


def calibrate(stale: torch.nn.Module, calib: Path, count: int | None, order: str, seed: int,
              stop: StopRule | None = None) -> tuple[torch.nn.Module, int, bool | None]:
    model = copy.deepcopy(stale)
    layers, _ = find_batchnorm_layers(model)
    spec = describe_dataset(calib, ReadOptions(max_samples=count, order=order, seed=seed))
    with spec.open() as data:
        result = calibration_pass(
            model, layers, iter_batches(data, step_ranges(spec.num_samples, BATCH)), mode="sync",
            collective=SingleProcessCollective(), stop=stop,
        )
    apply_statistics(layers, result.stats, result.steps)
    return model.eval(), result.samples, result.convergence.converged if result.convergence else None


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(x)
    top1 = (logits.argmax(1) == y).double().mean().item()
    return top1, torch.nn.functional.cross_entropy(logits.double(), y).item()


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="keep the trained model here between runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bnrecal-samples-") as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        stale, calib, x, y = prepare(work)
        top1, ce = evaluate(stale, x, y)
        print(f"stale statistics: top-1 {top1:.3f}, cross-entropy {ce:.3f} on {len(y)} held-out scans\n")
        print("| samples | path order (by class): top-1 | cross-entropy | fair order (5 seeds): top-1 | cross-entropy |")
        print("|---|---|---|---|---|")
        for count in COUNTS:
            given = evaluate(calibrate(stale, calib, count, "given", 0)[0], x, y)
            fair = [evaluate(calibrate(stale, calib, count, "shuffled", seed)[0], x, y) for seed in SEEDS]
            print(f"| {count} | {given[0]:.3f} | {given[1]:.3f} | {spread([f[0] for f in fair])} | "
                  f"{spread([f[1] for f in fair])} |", flush=True)
        print(f"\nmax_samples auto (fair order, 5 seeds; at least {MIN_STEPS} steps of {BATCH}):\n")
        print("| tolerance | samples used | converged | top-1 | cross-entropy |")
        print("|---|---|---|---|---|")
        for tolerance in TOLERANCES:
            runs = [calibrate(stale, calib, None, "shuffled", seed, StopRule(tolerance)) for seed in SEEDS]
            scores = [evaluate(model, x, y) for model, _, _ in runs]
            used = [samples for _, samples, _ in runs]
            converged = sum(bool(c) for _, _, c in runs)
            print(f"| {tolerance:g} | {min(used)}-{max(used)} (median {int(statistics.median(used))}) | "
                  f"{converged}/{len(runs)} | {spread([s[0] for s in scores])} | {spread([s[1] for s in scores])} |",
                  flush=True)


if __name__ == "__main__":
    main()
