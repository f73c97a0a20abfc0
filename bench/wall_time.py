"""End-to-end wall time as a user meets it: fresh processes, beside ``update_bn`` run the same way.

Two jobs on a torchvision resnet18 (10 classes, random weights): 64 samples of 3x32x32
(the small job) and 512 samples of 3x224x224, batches of 32. Each command is a fresh
Python process timed from start to exit (importing torch included), as a user runs it:

- ``update_bn``: ``torch.optim.swa_utils.update_bn(loader, model)`` (the baseline);
- ``recalibrate K=1`` / ``K=2``: ``bnrecal.recalibrate(model, loader, workers=K)`` (K=1 runs
  in the calling process, K=2 starts an embedded Ray);
- ``calibrate K=1`` / ``K=2``: ``bnrecal calibrate --workers K`` on the same checkpoint and
  data saved as ``.npy``;
- ``ray start``: an embedded Ray started the product's lean way and two rank actors (the
  product's own, their code loaded: torch, Ray, the engine) started in it, then stopped,
  timed inside the process: what K=2 pays over K=1 before the ranks build the model (a
  pickled torchvision model makes each rank import torchvision too, ~1.3 s more).

Children run in a user's environment (``fresh_process.user_environment``): no Ray address of
this shell's, and Python's bytecode cache on, as an install has it.

Every round runs every command once, in turn, so that each command's time can be paired
with the baseline's of the same round: the ratios are the median over rounds of command /
update_bn of that round, less moved by a machine that others share than the times
themselves. Printed: per job and command the median and min wall time, the paired ratio,
the targets (K=1 within 1.2x of update_bn on the small job and faster on the
512-sample job; K=2 within 5 s of K=1 on the small job) as met or NOT met, and the load.

``--busy N`` runs every command beside N busy processes (a spinning Python loop each, one
per CPU for ``--busy 0``): a user's machine is rarely idle, and a pass whose kernels wait for
every thread of a busy machine loses its lead over ``update_bn`` there, not on a quiet one.

    .venv/bin/python bench/wall_time.py [--rounds 3] [--jobs small,large] [--busy N] [--only 'calibrate K=1']
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fresh_process import user_environment  # bench/fresh_process.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
BATCH = 32
JOBS = {"small": (64, 32), "large": (512, 224)}

PYTHON_API = """
import sys, numpy as np, torch, torchvision
from torch.utils.data import DataLoader, TensorDataset
model = torchvision.models.resnet18(weights=None, num_classes=10)
model.load_state_dict(torch.load(sys.argv[2], weights_only=True))
loader = DataLoader(TensorDataset(torch.from_numpy(np.load(sys.argv[3]))), batch_size={batch})
if sys.argv[1] == "update_bn":
    torch.optim.swa_utils.update_bn(loader, model)
else:
    import bnrecal
    bnrecal.recalibrate(model, loader, workers=int(sys.argv[1]), progress=False)
"""

RAY_START = """
import time
import torch  # the driver has it already, as every caller does
started = time.perf_counter()
import ray
imported = time.perf_counter()
from bnrecal.service.run.cluster import ensure_ray, shutdown_embedded
from bnrecal.workers.ranks.gangs.pool import Gang, GangKey
ready = time.perf_counter()
ensure_ray(None, min_cpus=2)
up = time.perf_counter()
gang = Gang.start(GangKey(2, 1.0, 0.0, "SPREAD", "cpu"), 60, None)
ray.get([actor.node.remote() for actor in gang.actors])
actors = time.perf_counter()
gang.kill()
shutdown_embedded()
print(f"{imported - started:.3f} {up - ready:.3f} {actors - up:.3f} {time.perf_counter() - actors:.3f}")
"""


def load() -> str:
    """The machine's load averages over 1, 5 and 15 minutes, and its CPUs."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def inputs(folder: Path, samples: int, size: int) -> tuple[Path, Path]:
    """A resnet18 checkpoint (10 classes) and ``samples`` calibration samples of 3 x size x size."""
    import torch
    import torchvision

    torch.manual_seed(0)
    checkpoint = folder / "resnet18.pt"
    if not checkpoint.exists():
        torch.save(torchvision.models.resnet18(weights=None, num_classes=10).state_dict(), checkpoint)
    data = folder / f"calib-{samples}x{size}.npy"
    rows = np.random.default_rng(0).normal(size=(samples, 3, size, size)).astype(np.float32)
    np.save(data, rows)
    return checkpoint, data


def commands(folder: Path, checkpoint: Path, data: Path) -> dict[str, list[str]]:
    """Each command of a job, as a fresh process."""
    python = sys.executable
    api = PYTHON_API.replace("{batch}", str(BATCH))
    cli = [python, "-m", "bnrecal.service.cli", "calibrate", "--arch", "torchvision:resnet18",
           "--model-kwargs", '{"num_classes": 10}', "--checkpoint", str(checkpoint), "--data", str(data),
           "--batch-size", str(BATCH), "--out", str(folder / "out.pt")]
    return {
        "update_bn": [python, "-c", api, "update_bn", str(checkpoint), str(data)],
        "recalibrate K=1": [python, "-c", api, "1", str(checkpoint), str(data)],
        "recalibrate K=2": [python, "-c", api, "2", str(checkpoint), str(data)],
        "calibrate K=1": [*cli, "--workers", "1"],
        "calibrate K=2": [*cli, "--workers", "2"],
    }


def timed(command: list[str]) -> tuple[float, str]:
    """Wall seconds of one fresh process (which must succeed), and its stdout."""
    environment = user_environment()
    environment["PYTHONPATH"] = str(ROOT)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="times every command runs (interleaved)")
    parser.add_argument("--jobs", default="small,large", help="which jobs: small, large or both")
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--only", help="only these commands (comma-separated, e.g. 'calibrate K=1'), beside update_bn")
    parser.add_argument("--busy", type=int, help="run beside this many busy processes (0: one per CPU)")
    args = parser.parse_args()
    print(f"before: {load()}", flush=True)
    results: dict[str, dict[str, list[float]]] = {}
    ray_start: list[list[float]] = []
    busy = args.busy if args.busy is None or args.busy > 0 else os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bnrecal-bench-") as temp, busy_processes(busy or 0):
        if busy:
            print(f"beside {busy} busy processes", flush=True)
        folder = Path(temp)
        for job in args.jobs.split(","):
            samples, size = JOBS[job]
            checkpoint, data = inputs(folder, samples, size)
            runs = {name: command for name, command in commands(folder, checkpoint, data).items()
                    if not args.only or name == "update_bn" or name in args.only.split(",")}
            results[job] = {name: [] for name in runs}
            for round_ in range(args.rounds):
                for name, command in runs.items():
                    seconds, _ = timed(command)
                    results[job][name].append(seconds)
                    print(f"  {job} round {round_ + 1}: {name:16s} {seconds:6.2f} s", flush=True)
                if job == args.jobs.split(",")[0] and any(name.endswith("K=2") for name in runs):
                    _, out = timed([sys.executable, "-c", RAY_START])
                    ray_start.append([float(v) for v in out.split()])
    print(f"after:  {load()}\n")
    verdicts = report(results, ray_start)
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "ray_start": ray_start, "targets": verdicts}, indent=2))


@contextlib.contextmanager
def busy_processes(count: int):  # noqa: ANN201 - a context manager
    """``count`` processes spinning a Python loop for as long as the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def report(results: dict[str, dict[str, list[float]]], ray_start: list[list[float]]) -> dict[str, bool]:
    """Print the table and the targets; returns each target as met or not."""
    print(f"{'job':28s} {'command':16s} {'median s':>9s} {'min s':>7s} {'paired ratio':>13s}")
    for job, runs in results.items():
        samples, size = JOBS[job]
        base = runs["update_bn"]
        for name, times in runs.items():
            ratio = statistics.median(t / b for t, b in zip(times, base))
            print(f"{f'{job}: {samples} x 3x{size}x{size}':28s} {name:16s} {statistics.median(times):9.2f} "
                  f"{min(times):7.2f} {ratio:12.2f}x")
    verdicts: dict[str, bool] = {}

    def target(text: str, met: bool) -> None:
        verdicts[text] = met
        print(f"  {text}: {'met' if met else 'NOT met'}")

    print("\ntargets (paired over rounds):")
    if "small" in results:
        small = results["small"]
        for api in ("recalibrate", "calibrate"):
            if f"{api} K=1" not in small:  # left out by --only
                continue
            one = statistics.median(t / b for t, b in zip(small[f"{api} K=1"], small["update_bn"]))
            target(f"small job, {api} K=1 within 1.2x of update_bn ({one:.2f}x)", one <= 1.2)
            if f"{api} K=2" in small:
                gap = statistics.median(two - one for two, one in zip(small[f"{api} K=2"], small[f"{api} K=1"]))
                target(f"small job, {api} K=2 within 5 s of K=1 ({gap:+.2f} s)", gap <= 5.0)
    if "large" in results:
        large = results["large"]
        for api in ("recalibrate", "calibrate"):
            if f"{api} K=1" in large:
                one = statistics.median(t / b for t, b in zip(large[f"{api} K=1"], large["update_bn"]))
                target(f"512-sample job, {api} K=1 faster than update_bn ({one:.2f}x)", one < 1.0)
    if ray_start:
        parts = [statistics.median(column) for column in zip(*ray_start)]
        print(f"\nembedded Ray (lean), median of {len(ray_start)}: import ray {parts[0]:.2f} s, start {parts[1]:.2f} s, "
              f"two rank actors up (their code loaded) {parts[2]:.2f} s, shutdown {parts[3]:.2f} s: "
              f"{sum(parts):.2f} s that K=2 pays over K=1 before its ranks build the model")
    return verdicts


if __name__ == "__main__":
    main()
