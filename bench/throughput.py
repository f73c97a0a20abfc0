"""Calibration throughput: bnrecal against what users do today, in one run.

Same model and data for every contender (torchvision resnet18, 3x224x224, global batch
32): a plain eval forward in this process (the limit: calibration cannot beat a
forward pass), ``torch.optim.swa_utils.update_bn`` (today's tool), and bnrecal with
1 worker (sync), 2 workers (sync, 1 thread each) and 2 workers (local). bnrecal's rate
is over its calibration pass (the report's ``seconds``); the wall time with actor
start-up is printed beside it. Ratios are against baselines measured in this run.

    .venv/bin/python bench/throughput.py [--samples 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torchvision
from torch.optim.swa_utils import update_bn


def eval_forward(model: torch.nn.Module, data: np.ndarray, batch: int) -> float:
    """Seconds for a plain eval-mode forward over the data."""
    model.eval()
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(data), batch):
            model(torch.from_numpy(np.array(data[start : start + batch])))
    return time.perf_counter() - started


def swa_update_bn(model: torch.nn.Module, data: np.ndarray, batch: int) -> float:
    """Seconds for ``torch.optim.swa_utils.update_bn`` over the data."""
    loader = [torch.from_numpy(np.array(data[s : s + batch])) for s in range(0, len(data), batch)]
    started = time.perf_counter()
    update_bn(loader, model)
    return time.perf_counter() - started


def bnrecal(checkpoint: Path, data: Path, workers: int, mode: str, cpus: float, batch: int) -> tuple[float, float]:
    """(calibration-pass seconds, wall seconds) for one bnrecal run on the shared Ray instance."""
    from service.recalibrate import RecalibrationRequest, recalibrate
    from service.settings import Settings

    settings = Settings(cpus_per_worker=cpus, data_dir=Path(tempfile.mkdtemp()))
    request = RecalibrationRequest(
        arch="torchvision:resnet18", checkpoint=checkpoint, data=data, workers=workers, batch_size=batch, mode=mode
    )
    started = time.perf_counter()
    result = recalibrate(request, settings)
    return result.report["seconds"], time.perf_counter() - started


def main() -> None:
    """Run every contender once and print a markdown table of samples/s and ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="bnrecal-bench-"))
    rng = np.random.default_rng(0)
    data_path = folder / "x.npy"
    np.save(data_path, rng.standard_normal((args.samples, 3, 224, 224), dtype=np.float32))
    data = np.load(data_path, mmap_mode="r")
    model = torchvision.models.resnet18(weights=None)
    checkpoint = folder / "resnet18.pt"
    torch.save(model.state_dict(), checkpoint)

    eval_forward(model, data[: args.batch], args.batch)  # warm-up
    rows: list[tuple[str, float, float | None]] = []
    t_eval = eval_forward(model, data, args.batch)
    rows.append((f"eval forward, 1 process, {args.threads} threads", t_eval, None))
    t_swa = swa_update_bn(torchvision.models.resnet18(weights=None), data, args.batch)
    rows.append((f"swa_utils.update_bn, {args.threads} threads", t_swa, None))

    from service.cluster import ensure_ray

    ensure_ray(None, min_cpus=args.threads)
    runs = [
        ("bnrecal 1 worker sync", 1, "sync", float(args.threads)),
        ("bnrecal 2 workers sync (1 thread each)", 2, "sync", 1.0),
        ("bnrecal 2 workers local (1 thread each)", 2, "local", 1.0),
    ]
    bnrecal(checkpoint, data_path, 1, "sync", float(args.threads), args.batch)  # warm-up: worker start, imports
    for name, workers, mode, cpus in runs:
        seconds, wall = bnrecal(checkpoint, data_path, workers, mode, cpus, args.batch)
        rows.append((name, seconds, wall))

    rate = {name: args.samples / seconds for name, seconds, _ in rows}
    one_worker = rate["bnrecal 1 worker sync"]
    print(f"\nresnet18, {args.samples} samples of 3x224x224, batch {args.batch}, {os.cpu_count()} cores\n")
    print("| run | samples/s | vs eval forward | vs update_bn | vs 1 worker | wall s (with start-up) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, seconds, wall in rows:
        r = rate[name]
        wall_text = f"{wall:.1f}" if wall is not None else f"{seconds:.1f}"
        print(
            f"| {name} | {r:.1f} | {r / rate[rows[0][0]]:.2f}x | {r / rate[rows[1][0]]:.2f}x | "
            f"{r / one_worker:.2f}x | {wall_text} |"
        )


if __name__ == "__main__":
    main()
