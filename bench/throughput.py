"""Calibration throughput: bnrecal against what users do today, in one run.

For each model (torchvision resnet18 and, with the timm extra, timm efficientnet_b0;
3x224x224, global batch 32) the same data goes through:

- a plain eval forward in this process, in the default layout and in channels-last
  (the limit: calibration cannot beat the model's fastest forward pass);
- ``torch.optim.swa_utils.update_bn`` as users call it (default layout): today's tool;
- bnrecal with 1 worker (sync, every thread), and for resnet18 2 workers (sync and
  local, 1 thread each).

bnrecal's rate is over its calibration pass (the report's ``seconds``, on the rank,
data loading and the layout measurement included); the wall time with actor start-up
is printed beside it. The layout measurement runs one of the pass's steps in the
slower layout, a cost that shrinks with the job's length: the default 512 samples (16
steps) is a small real calibration set. Ratios are against baselines measured in this run, and each
target of the README is printed as met or NOT met.

    .venv/bin/python bench/throughput.py [--samples 512] [--threads 2] [--models resnet18,efficientnet_b0]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.optim.swa_utils import update_bn

MODELS = {
    "resnet18": ("torchvision:resnet18", lambda: __import__("torchvision").models.resnet18(weights=None)),
    "efficientnet_b0": ("timm:efficientnet_b0", lambda: __import__("timm").create_model("efficientnet_b0")),
}


@dataclass
class Row:
    """One contender's time over the data (and wall time with start-up, for bnrecal)."""

    name: str
    seconds: float
    wall: float | None = None
    layout: str = ""


def batches(data: np.ndarray, batch: int) -> list[torch.Tensor]:
    """The data as the list of batches a user's loader would yield."""
    return [torch.from_numpy(np.array(data[s : s + batch])) for s in range(0, len(data), batch)]


def eval_forward(model: torch.nn.Module, loader: list[torch.Tensor], layout: torch.memory_format) -> float:
    """Seconds for a plain eval-mode forward over the data in ``layout`` (after one warm-up batch)."""
    model = copy.deepcopy(model).eval().to(memory_format=layout)
    with torch.inference_mode():
        model(loader[0].contiguous(memory_format=layout))
        started = time.perf_counter()
        for x in loader:
            model(x.contiguous(memory_format=layout))
    return time.perf_counter() - started


def swa_update_bn(model: torch.nn.Module, loader: list[torch.Tensor]) -> float:
    """Seconds for ``torch.optim.swa_utils.update_bn`` over the data (after one warm-up batch)."""
    model = copy.deepcopy(model)
    update_bn(loader[:1], model)
    started = time.perf_counter()
    update_bn(loader, model)
    return time.perf_counter() - started


def bnrecal(arch: str, checkpoint: Path, data: Path, workers: int, mode: str, cpus: float, batch: int) -> Row:
    """One bnrecal run on the shared Ray instance: its calibration pass and its wall time."""
    from service.recalibrate import RecalibrationRequest, recalibrate
    from service.settings import Settings

    settings = Settings(cpus_per_worker=cpus, data_dir=Path(tempfile.mkdtemp()))
    request = RecalibrationRequest(
        arch=arch, checkpoint=checkpoint, data=data, workers=workers, batch_size=batch, mode=mode
    )
    started = time.perf_counter()
    report = recalibrate(request, settings).report
    layouts = "/".join(sorted(set(report["memory_formats"])))
    return Row("", report["seconds"], time.perf_counter() - started, layouts)


def bench_model(key: str, data_path: Path, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    """Every contender on one model; prints its table and returns samples/s by contender."""
    arch, factory = MODELS[key]
    torch.manual_seed(0)
    model = factory().eval()
    checkpoint = folder / f"{key}.pt"
    torch.save(model.state_dict(), checkpoint)
    loader = batches(np.load(data_path, mmap_mode="r"), args.batch)
    rows = [
        Row("eval forward, default layout", eval_forward(model, loader, torch.contiguous_format)),
        Row("eval forward, channels-last", eval_forward(model, loader, torch.channels_last)),
        Row("swa_utils.update_bn (as users call it)", swa_update_bn(model, loader)),
    ]
    runs = [("bnrecal 1 worker sync", 1, "sync", float(args.threads))]
    if key == "resnet18":
        runs += [("bnrecal 2 workers sync (1 thread each)", 2, "sync", 1.0),
                 ("bnrecal 2 workers local (1 thread each)", 2, "local", 1.0)]
    bnrecal(arch, checkpoint, data_path, 1, "sync", float(args.threads), args.batch)  # warm-up: workers, imports
    for name, workers, mode, cpus in runs:
        row = bnrecal(arch, checkpoint, data_path, workers, mode, cpus, args.batch)
        row.name = name
        rows.append(row)
    rate = {row.name: args.samples / row.seconds for row in rows}
    best_eval = max(rate[rows[0].name], rate[rows[1].name])
    swa = rate[rows[2].name]
    one = rate["bnrecal 1 worker sync"]
    print(f"\n### {arch}: {args.samples} samples of 3x224x224, batch {args.batch}, {args.threads} threads\n")
    print("| run | samples/s | vs fastest eval | vs update_bn | vs 1 worker | layout | wall s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for row in rows:
        r = rate[row.name]
        wall = f"{row.wall:.1f}" if row.wall is not None else f"{row.seconds:.1f}"
        print(f"| {row.name} | {r:.1f} | {r / best_eval:.2f}x | {r / swa:.2f}x | {r / one:.2f}x | {row.layout} | {wall} |")
    return {"best_eval": best_eval, "update_bn": swa, **rate}


def check(name: str, value: float, target: float) -> None:
    """Print one README target as met or NOT met."""
    print(f"- {name}: {value:.2f}x (target >= {target:.2f}x) {'met' if value >= target else 'NOT met'}")


def main() -> None:
    """Run every contender once per model, print the tables and the targets."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--models", default="resnet18,efficientnet_b0")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="bnrecal-bench-"))
    data_path = folder / "x.npy"
    rng = np.random.default_rng(0)
    np.save(data_path, rng.standard_normal((args.samples, 3, 224, 224), dtype=np.float32))

    from service.cluster import ensure_ray

    ensure_ray(None, min_cpus=args.threads)
    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    results = {}
    for key in args.models.split(","):
        if key == "efficientnet_b0":
            try:
                import timm  # noqa: F401
            except ImportError:
                print("\n(timm not installed: efficientnet_b0 skipped; pip install -e '.[timm]')")
                continue
        results[key] = bench_model(key, data_path, args, folder)
    print("\nTargets:")
    if "resnet18" in results:
        r = results["resnet18"]
        check("resnet18, 1 worker vs update_bn", r["bnrecal 1 worker sync"] / r["update_bn"], 1.3)
        check("resnet18, 1 worker vs fastest eval forward", r["bnrecal 1 worker sync"] / r["best_eval"], 0.95)
        check(
            "resnet18, 2 workers x 1 thread vs 1 worker x 2 threads (sync)",
            r["bnrecal 2 workers sync (1 thread each)"] / r["bnrecal 1 worker sync"],
            0.9,
        )
    if "efficientnet_b0" in results:
        r = results["efficientnet_b0"]
        check("efficientnet_b0, 1 worker vs update_bn", r["bnrecal 1 worker sync"] / r["update_bn"], 1.0)


if __name__ == "__main__":
    main()
