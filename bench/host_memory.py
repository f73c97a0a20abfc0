"""The job host's memory as the evaluation set grows tenfold: a fresh ``bnrecal calibrate
--workers 2`` with ``--eval-data``, ``--onnx`` and ``--onnx-int8`` (its INT8 evaluations), on
N and on 10 N real photos, the peak resident memory of the command's own process (the
driver: the job host) sampled every 20 ms with psutil. The ranks' processes are Ray's
workers, not counted: they read the evaluation data, the host only its labels.

The photos are the benches' crops of scikit-learn's two sample images (``tests/shards.py``),
read at 64x64 by a torchvision resnet18 (10 classes, random weights, stale statistics).

    .venv/bin/python bench/host_memory.py [--photos 64] [--factor 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from fresh_process import user_environment  # bench/fresh_process.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def peak_rss(command: list[str]) -> tuple[float, float]:
    """Peak resident MiB of the command's own process, and its wall seconds; it must succeed."""
    environment = user_environment()
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=environment)
    process, peak = psutil.Process(child.pid), [0]

    def sample() -> None:
        while child.poll() is None:
            try:
                peak[0] = max(peak[0], process.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = child.communicate()
    sampler.join()
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} failed ({child.returncode}):\n{err[-2000:]}")
    return peak[0] / 2**20, time.perf_counter() - started


def main() -> None:
    import torch
    import torchvision

    from tests.shards import photos, write_folder

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=64)
    parser.add_argument("--factor", type=int, default=10)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(prefix="bnrecal-host-memory-") as temp:
        folder = Path(temp)
        calibration = write_folder(folder / "calibration", photos(args.photos, size=80, classes=10))
        torch.manual_seed(0)
        model = torchvision.models.resnet18(weights=None, num_classes=10)
        torch.save(model.state_dict(), folder / "stale.pt")
        rows = []
        for count in (args.photos, args.photos * args.factor):
            evaluation = write_folder(folder / f"eval-{count}", photos(count, size=80, classes=10, seed=1))
            command = [
                str(Path(sys.executable).with_name("bnrecal")), "calibrate", "--arch", "torchvision:resnet18",
                "--model-kwargs", '{"num_classes": 10}', "--checkpoint", str(folder / "stale.pt"),
                "--data", str(calibration), "--eval-data", str(evaluation), "--workers", "2", "--batch-size", "32",
                "--transform", '{"resize": 72, "crop": 64}', "--out", str(folder / "out.pt"),
                "--onnx", str(folder / "m.onnx"), "--onnx-int8", str(folder / "m8.onnx"),
                "--report", str(folder / "report.json"),
            ]
            mib, seconds = peak_rss(command)
            report = json.loads((folder / "report.json").read_text())
            scored = report["int8"]["evaluation"]["samples"]
            rows.append((count, mib, seconds))
            print(f"  {count:5d} evaluation photos ({scored} scored on the ranks): host peak {mib:7.1f} MiB, "
                  f"{seconds:5.1f} s", flush=True)
    (small, small_mib, _), (large, large_mib, _) = rows
    print(f"host peak memory at {large} / {small} evaluation photos: {large_mib / small_mib:.3f}x "
          f"({large_mib - small_mib:+.1f} MiB)")


if __name__ == "__main__":
    main()
