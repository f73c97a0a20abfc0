"""The whole job against the statistics alone, as a user runs them: fresh processes of
``bnrecal calibrate --workers 2`` on real photos, once for the statistics only and once with
``--eval-data`` (the same photos), ``--onnx`` and ``--onnx-int8``.

The photos are crops of the two sample images that ship with scikit-learn, recoloured per
crop and encoded as JPEG (``tests/shards.py``), in class folders, read with the ImageNet
transform at 224 by a torchvision resnet18 (10 classes, random weights, stale statistics).
Rounds run the two commands in turn, so each whole job is paired with the statistics-only
job of its round: the ratio printed is the median over rounds of whole / statistics. The
whole job's ``timeline`` (docs/report.md) from the last round shows where its time went.

``--bnrecal`` runs another checkout's command (its venv's ``bnrecal``), so the same bench
measures an older commit beside this one:

    .venv/bin/python bench/whole_job.py [--photos 256] [--rounds 2] [--bnrecal PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepare(folder: Path, photos: int) -> tuple[Path, Path]:
    """The photos in class folders and a resnet18 checkpoint whose BN statistics are stale."""
    import torch
    import torchvision

    sys.path.insert(0, str(ROOT))
    from tests.shards import photos as make_photos
    from tests.shards import write_folder

    images = write_folder(folder / "photos", make_photos(photos, size=256, classes=10))
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    checkpoint = folder / "stale.pt"
    torch.save(model.state_dict(), checkpoint)
    return images, checkpoint


def run(command: list[str]) -> float:
    """Wall seconds of one fresh process, which must succeed."""
    environment = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "BNRECAL_RAY_ADDRESS")}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bnrecal", default=str(Path(sys.executable).with_name("bnrecal")),
                        help="the bnrecal command to time (another checkout's venv to compare)")
    args = parser.parse_args()
    print(f"{args.bnrecal}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(prefix="bnrecal-whole-job-") as temp:
        folder = Path(temp)
        images, checkpoint = prepare(folder, args.photos)
        base = [args.bnrecal, "calibrate", "--arch", "torchvision:resnet18", "--model-kwargs", '{"num_classes": 10}',
                "--checkpoint", str(checkpoint), "--data", str(images), "--workers", "2", "--batch-size", "32",
                "--transform", '{"resize": 256, "crop": 224}', "--out", str(folder / "out.pt")]
        whole = [*base, "--eval-data", str(images), "--onnx", str(folder / "m.onnx"),
                 "--onnx-int8", str(folder / "m-int8.onnx"), "--report", str(folder / "report.json")]
        times: dict[str, list[float]] = {"statistics": [], "whole job": []}
        for round_ in range(args.rounds):
            for name, command in (("statistics", base), ("whole job", whole)):
                times[name].append(run(command))
                print(f"  round {round_ + 1}: {name:10s} {times[name][-1]:6.1f} s", flush=True)
        report = json.loads((folder / "report.json").read_text())
    ratios = [w / s for w, s in zip(times["whole job"], times["statistics"])]
    print(f"statistics only: median {statistics.median(times['statistics']):.1f} s")
    print(f"whole job:       median {statistics.median(times['whole job']):.1f} s")
    print(f"whole / statistics: {statistics.median(ratios):.2f}x (per round: {', '.join(f'{r:.2f}' for r in ratios)})")
    for entry in report.get("timeline", []):
        print(f"  {entry['phase']:32s} {entry['seconds']:7.2f} s  {entry['samples']:6d} samples  "
              f"{entry['passes']} passes  {entry['where']}")
    decoding = report.get("decoding")
    if decoding is not None:  # an older checkout's report has none
        used = report["samples"] + report["evaluation"]["data"]["samples"]
        print(f"samples decoded by the ranks: {decoding['decoded']} for {used} samples used "
              f"({decoding['reused']} reads from what they kept)")
    print(f"after: load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
