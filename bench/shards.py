"""The same real photos as an image folder, as WebDataset tar shards and as Parquet: how fast
each is read (decoded and transformed), each pass in a fresh process, and what a calibration
on each gives (statistics and top-1, ``--order given``).

The photos are crops of the two sample images that ship with scikit-learn
(``load_sample_images``), recoloured per crop and encoded as JPEG once (``tests/shards.py``):
the three formats hold the very same bytes in the same order. Read passes run in turn
(folder, tar, Parquet, folder, ...) in fresh processes (``python bench/shards.py --read
FORMAT PATH``): each is timed from after its imports (the format's reader library too,
pyarrow for Parquet, which a rank imports once, on first use: its import is printed apart):
it describes the data (the tar shards' index from its cache after the first pass, as a
second job would) and reads every sample in the seeded shuffled order with the ImageNet
evaluation transform at 224, one rank, no DataLoader workers. The ratio
format / folder is taken pass by pass, so a machine whose speed drifts moves both alike.
Then ``bnrecal calibrate --workers 1 --order given`` runs on each format (a torchvision
resnet18 with stale statistics, evaluation on labelled photos in the same format), and the
recalibrated checkpoints' BN buffers and the top-1 are compared.

    PYTHONPATH=. .venv/bin/python bench/shards.py [--photos 2000] [--size 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FORMATS = ("folder", "tar", "parquet")


def read_pass(path: str) -> None:
    """One pass, in this (fresh) process: describe, then read every sample; prints the seconds."""
    import torchvision.transforms.v2.functional  # noqa: F401 - imported before the clock starts, as in a warm rank

    from bnrecal.workers.data import ReadOptions, describe_dataset, iter_batches
    from bnrecal.workers.ranks.sharding import rank_ranges

    importing = time.perf_counter()
    if Path(path).name.startswith("parquet"):  # its reader too: a rank imports it once, on first use
        import pyarrow.compute  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    imported = time.perf_counter() - importing
    started = time.perf_counter()
    spec = describe_dataset(Path(path) if "{" not in path else path, ReadOptions(order="shuffled"))
    with spec.open() as data:
        for _ in iter_batches(data, rank_ranges(spec.num_samples, 64, 1, 0)):
            pass
    print(json.dumps({"seconds": time.perf_counter() - started, "samples": spec.num_samples, "import": imported}))


def timed(path: Path | str) -> tuple[float, int, float]:
    """One fresh pass: its seconds, the samples read, and the seconds its format's reader
    library took to import (before the clock: pyarrow for Parquet)."""
    out = subprocess.run(
        [sys.executable, __file__, "--read", str(path)], check=True, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    ).stdout
    found = json.loads(out.strip().splitlines()[-1])
    return found["seconds"], found["samples"], found["import"]


def write_formats(root: Path, count: int, size: int) -> dict[str, Path | str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.shards import folder_order, photos, write_folder, write_parquet, write_tar_shards

    items = photos(count, size=size, classes=10)
    ordered = folder_order(items)
    write_folder(root / "folder", items)
    shards = write_tar_shards(root / "tar", ordered, 500)
    write_parquet(root / "parquet", ordered, 1000, row_group=100)
    evaluation = folder_order(photos(300, size=size, seed=1, classes=10))
    write_folder(root / "eval-folder", evaluation)
    write_tar_shards(root / "eval-tar", evaluation, 300)
    write_parquet(root / "eval-parquet", evaluation, 300)
    return {
        "folder": root / "folder", "tar": str(root / "tar" / f"train-{{000000..{len(shards) - 1:06d}}}.tar"),
        "parquet": root / "parquet", "eval-folder": root / "eval-folder", "eval-tar": root / "eval-tar",
        "eval-parquet": root / "eval-parquet",
    }


def calibrate(root: Path, sources: dict[str, Path | str], fmt: str, samples: int) -> tuple[dict, float, float]:
    """``bnrecal calibrate`` on one format; returns the report, the wall seconds and the CPU
    seconds of the command (and its DataLoader workers): on a shared machine the CPU time is
    what to compare."""
    out = root / f"out-{fmt}.pt"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "bnrecal.service.cli", "calibrate", "--arch", "torchvision:resnet18",
         "--model-kwargs", '{"num_classes": 10}', "--checkpoint", str(root / "stale.pt"), "--data",
         str(sources[fmt]), "--eval-data", str(sources[f"eval-{fmt}"]), "--order", "given", "--max-samples",
         str(samples), "--batch-size", "32", "--transform", '{"resize": 96, "crop": 96}', "--out", str(out),
         "--report", str(root / f"report-{fmt}.json")],
        check=True, capture_output=True, text=True,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return json.loads((root / f"report-{fmt}.json").read_text()), wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=2000)
    parser.add_argument("--size", type=int, default=256, help="photo side in pixels (JPEG quality 90)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calibration-samples", type=int, default=512)
    parser.add_argument("--read", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.read:
        read_pass(args.read)
        return
    import torch
    import torchvision

    with tempfile.TemporaryDirectory(prefix="bnrecal-shards-") as folder:
        root = Path(folder)
        os.environ["XDG_CACHE_HOME"] = str(root / "cache")  # the shard index cache of this run only
        sources = write_formats(root, args.photos, args.size)
        sizes = {fmt: sum(f.stat().st_size for f in root.joinpath(fmt).rglob("*") if f.is_file()) for fmt in FORMATS}
        print(f"{args.photos} photos {args.size}x{args.size} JPEG; bytes: "
              + ", ".join(f"{fmt} {sizes[fmt] / 2**20:.1f} MiB" for fmt in FORMATS)
              + f"; load average {os.getloadavg()[0]:.1f} at the start")
        times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
        imports: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
        for fmt in FORMATS:
            timed(sources[fmt])  # warm-up: page cache, the tar index built and cached
        for _ in range(args.rounds):  # --rounds 0: the calibrations only
            for fmt in FORMATS:
                seconds, count, imported = timed(sources[fmt])
                times[fmt].append(seconds)
                imports[fmt].append(imported)
        print("| format | pass (s, median) | images/s | pass / folder pass (min-max) | reader's import (s) |")
        print("|---|---|---|---|---|")
        for fmt in FORMATS if args.rounds else ():
            ratios = [t / f for t, f in zip(times[fmt], times["folder"])]
            median = statistics.median(times[fmt])
            print(f"| {fmt} | {median:.2f} | {count / median:.0f} | {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) | {statistics.median(imports[fmt]):.2f} |", flush=True)

        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.BatchNorm2d):
                    module.running_mean.uniform_(-0.5, 0.5)
                    module.running_var.uniform_(0.5, 2.0)
        torch.save(model.state_dict(), root / "stale.pt")
        reports, outs = {}, {}
        for fmt in FORMATS:
            reports[fmt], seconds, cpu = calibrate(root, sources, fmt, args.calibration_samples)
            outs[fmt] = torch.load(root / f"out-{fmt}.pt", weights_only=True)
            top1 = reports[fmt]["evaluation"]["after"]["top1"]
            print(f"calibrate on {fmt}: {reports[fmt]['samples']} samples, top-1 after {top1:.4f}, "
                  f"{seconds:.1f} s wall, {cpu:.1f} s CPU", flush=True)
        for fmt in ("tar", "parquet"):
            same = all(torch.equal(outs[fmt][key], value) for key, value in outs["folder"].items())
            top1 = reports[fmt]["evaluation"]["after"]["top1"] == reports["folder"]["evaluation"]["after"]["top1"]
            print(f"{fmt} vs folder: checkpoint identical {same}, top-1 identical {top1}")


if __name__ == "__main__":
    main()
