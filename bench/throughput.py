"""Calibration throughput as users meet it: each contender in a fresh process, in one run.

For each model (torchvision resnet18 and, with the timm extra, timm efficientnet_b0;
3x224x224, global batch 32, 512 samples from a ``.npy`` file) every contender runs as
its own new process, best of ``--repeats`` (two by default):

- a plain eval forward (a script: build the model, load the checkpoint, loop over the
  file's batches), in the default layout and in channels-last: the limit, since
  calibration cannot beat the model's fastest forward pass;
- ``torch.optim.swa_utils.update_bn`` as users call it (the same script, default
  layout): today's tool;
- ``bnrecal calibrate`` (the real command, embedded Ray) with 1 worker x every thread,
  and for resnet18 2 workers x 1 thread in sync and local mode;
- the floor: the channels-last eval forward again, in the environment bnrecal's ranks
  run in (glibc malloc keeping freed memory mapped, ``workers.ranks.process.allocator``), to show
  what that gives a plain forward and how close to it calibration comes.

A script's rate is over its loop (the first batch, reading the file and torch's kernel
set-up included); bnrecal's is over its calibration pass (the report's ``seconds``, on
the rank: the same things included). The whole command's wall time is printed beside
each. Then, in this process, the warm figures: the same jobs run again on ranks kept
warm by a first job, as the server's warm pool runs them. Ratios are against baselines
measured in this run, and each target (docs/benchmarks.md) is printed as met or NOT met.

    .venv/bin/python bench/throughput.py [--samples 512] [--repeats 2] [--models resnet18,efficientnet_b0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bnrecal.workers.ranks.process.allocator import RANK_ENV_VARS

MODELS = {"resnet18": "torchvision:resnet18", "efficientnet_b0": "timm:efficientnet_b0"}
BIN = Path(sys.executable).parent
TUNED_EVAL = "eval forward, channels-last, ranks' allocator settings (floor)"
"""The floor: the fastest eval forward with the environment bnrecal's ranks run in
(``workers.ranks.process.allocator``), so the table shows what the allocator gives and what is left."""


def build(arch: str) -> torch.nn.Module:
    """The benchmark's model, as the user's script builds it."""
    family, name = arch.split(":")
    if family == "timm":
        import timm

        return timm.create_model(name)
    import torchvision

    return getattr(torchvision.models, name)(weights=None)


def script(args: argparse.Namespace) -> None:
    """A user's script in a fresh process: eval forward or ``update_bn`` over the file."""
    torch.set_num_threads(args.threads)
    model = build(args.arch)
    model.load_state_dict(torch.load(args.checkpoint, weights_only=True))
    data = np.load(args.data, mmap_mode="r")
    layout = torch.channels_last if args.layout == "channels_last" else torch.contiguous_format

    def loader():
        for start in range(0, len(data), args.batch):
            yield torch.from_numpy(np.array(data[start : start + args.batch])).contiguous(memory_format=layout)

    started = time.perf_counter()
    if args.script == "update_bn":
        from torch.optim.swa_utils import update_bn

        update_bn(loader(), model)
    else:
        model.eval().to(memory_format=layout)
        with torch.inference_mode():
            for x in loader():
                model(x)
    print(json.dumps({"seconds": time.perf_counter() - started}))


@dataclass
class Row:
    """One contender: its best rate's seconds, the wall time of that run, its layout."""

    name: str
    seconds: float
    wall: float
    layout: str = ""


def fresh(name: str, command: list[str], report: Path | None, repeats: int, env: dict[str, str]) -> Row:
    """Best of ``repeats`` fresh processes of ``command`` (seconds from its JSON line or report)."""
    best: Row | None = None
    for _ in range(repeats):
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        if report is None:
            row = Row(name, json.loads(done.stdout.strip().splitlines()[-1])["seconds"], wall)
        else:
            out = json.loads(report.read_text())
            row = Row(name, out["seconds"], wall, "/".join(sorted(set(out["memory_formats"]))))
        if best is None or row.seconds < best.seconds:
            best = row
    assert best is not None
    return best


def bench_model(key: str, data: Path, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    """Every contender on one model in fresh processes; prints its table, returns samples/s."""
    arch = MODELS[key]
    torch.manual_seed(0)
    checkpoint = folder / f"{key}.pt"
    torch.save(build(arch).state_dict(), checkpoint)
    env = dict(os.environ)
    common = ["--arch", arch, "--checkpoint", str(checkpoint), "--data", str(data), "--batch", str(args.batch)]
    python = [sys.executable, __file__, "script", *common, "--threads", str(args.threads)]
    rows = [
        fresh("eval forward, default layout", [*python, "--script", "eval"], None, args.repeats, env),
        fresh("eval forward, channels-last", [*python, "--script", "eval", "--layout", "channels_last"],
              None, args.repeats, env),
        fresh("swa_utils.update_bn (as users call it)", [*python, "--script", "update_bn"], None, args.repeats, env),
        fresh(TUNED_EVAL, [*python, "--script", "eval", "--layout", "channels_last"], None, args.repeats,
              {**env, **RANK_ENV_VARS}),
    ]
    runs = [("bnrecal 1 worker sync", 1, "sync", args.threads)]
    if key == "resnet18":
        runs += [("bnrecal 2 workers sync (1 thread each)", 2, "sync", 1),
                 ("bnrecal 2 workers local (1 thread each)", 2, "local", 1)]
    report = folder / "report.json"
    for name, workers, mode, threads in runs:
        command = [str(BIN / "bnrecal"), "calibrate", "--arch", arch, "--checkpoint", str(checkpoint),
                   "--data", str(data), "--out", str(folder / "out.pt"), "--report", str(report),
                   "-k", str(workers), "--mode", mode, "-b", str(args.batch)]
        rows.append(fresh(name, command, report, args.repeats, {**env, "BNRECAL_CPUS_PER_WORKER": str(threads)}))
    rate = {row.name: args.samples / row.seconds for row in rows}
    print(f"\n### {arch}: {args.samples} samples of 3x224x224, batch {args.batch}, "
          f"fresh processes, best of {args.repeats}\n")
    table(rows, rate)
    return {"best_eval": max(rate[rows[0].name], rate[rows[1].name]), "update_bn": rate[rows[2].name],
            "floor": rate[TUNED_EVAL], **rate}


def table(rows: list[Row], rate: dict[str, float]) -> None:
    """One markdown table of rates and ratios against the baselines of the same run: the
    fastest eval forward as users run it, ``update_bn``, and the floor (``TUNED_EVAL``)."""
    best_eval = max(rate[n] for n in rate if n.startswith("eval forward") and n != TUNED_EVAL)
    swa = rate["swa_utils.update_bn (as users call it)"]
    floor = rate[TUNED_EVAL]
    print("| run | samples/s | vs fastest eval | vs update_bn | vs floor | layout | wall s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for row in rows:
        r = rate[row.name]
        print(f"| {row.name} | {r:.1f} | {r / best_eval:.2f}x | {r / swa:.2f}x | {r / floor:.2f}x "
              f"| {row.layout} | {row.wall:.1f} |")


def warm(key: str, data: Path, args: argparse.Namespace, folder: Path, cold: dict[str, float]) -> None:
    """The same bnrecal jobs in this process on warm ranks (the server's warm pool)."""
    from bnrecal.service.run.cluster import ensure_ray
    from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate
    from bnrecal.service.settings import Settings

    ensure_ray(None, min_cpus=args.threads)
    print(f"\nwarm ({MODELS[key]}, in one process, ranks kept by a first job):\n")
    print("| run | samples/s | vs fastest eval (cold) | vs update_bn (cold) | layout |")
    print("|---|---:|---:|---:|---|")
    runs = [("bnrecal 1 worker sync", 1, "sync", args.threads)]
    if key == "resnet18":
        runs += [("bnrecal 2 workers sync (1 thread each)", 2, "sync", 1)]
    for name, workers, mode, threads in runs:
        settings = Settings(cpus_per_worker=float(threads), data_dir=Path(tempfile.mkdtemp()), warm_pool_idle_s=600)
        request = RecalibrationRequest(arch=MODELS[key], checkpoint=folder / f"{key}.pt", data=data,
                                       workers=workers, batch_size=args.batch, mode=mode)
        recalibrate(request, settings)
        report = recalibrate(request, settings).report
        r = args.samples / report["seconds"]
        layout = "/".join(sorted(set(report["memory_formats"])))
        print(f"| {name} | {r:.1f} | {r / cold['best_eval']:.2f}x | {r / cold['update_bn']:.2f}x | {layout} |")


def check(name: str, value: float, target: float) -> None:
    """Print one target (docs/benchmarks.md) as met or NOT met."""
    print(f"- {name}: {value:.2f}x (target >= {target:.2f}x) {'met' if value >= target else 'NOT met'}")


def main() -> None:
    """Run every contender in fresh processes per model, then the warm runs; print the targets."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("script", help="one baseline script run (used by the bench itself)")
    for flag in ("--arch", "--checkpoint", "--data"):
        one.add_argument(flag, required=True)
    one.add_argument("--script", choices=["eval", "update_bn"], required=True)
    one.add_argument("--layout", choices=["contiguous", "channels_last"], default="contiguous")
    one.add_argument("--batch", type=int, default=32)
    one.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", default="resnet18,efficientnet_b0")
    parser.add_argument("--no-warm", action="store_true", help="skip the warm in-process figures")
    args = parser.parse_args()
    if args.command == "script":
        script(args)
        return
    folder = Path(tempfile.mkdtemp(prefix="bnrecal-bench-"))
    data = folder / "x.npy"
    np.save(data, np.random.default_rng(0).standard_normal((args.samples, 3, 224, 224), dtype=np.float32))
    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f}")
    results = {}
    for key in args.models.split(","):
        if key == "efficientnet_b0":
            try:
                import timm  # noqa: F401
            except ImportError:
                print("\n(timm not installed: efficientnet_b0 skipped; pip install -e '.[timm]')")
                continue
        results[key] = bench_model(key, data, args, folder)
    if not args.no_warm:
        for key, cold in results.items():
            warm(key, data, args, folder, cold)
    print("\nTargets (fresh processes):")
    for key, r in results.items():
        check(f"{key}, 1 worker vs update_bn", r["bnrecal 1 worker sync"] / r["update_bn"], 1.3)
        check(f"{key}, 1 worker vs fastest eval forward", r["bnrecal 1 worker sync"] / r["best_eval"], 0.95)
    if "resnet18" in results:
        r = results["resnet18"]
        check("resnet18, 2 workers x 1 thread vs 1 worker x 2 threads (sync)",
              r["bnrecal 2 workers sync (1 thread each)"] / r["bnrecal 1 worker sync"], 0.9)


if __name__ == "__main__":
    main()
