"""How long the commands that run no model take, as a user meets them: a fresh process each.

``bnrecal --help``, ``jobs`` (table and ``--json``), ``status``, ``cancel`` (of a finished
job), ``delete`` (of an unknown job) and an argument error, each started ``--runs`` times
(after one warm-up run not counted) as ``python -m bnrecal.service.cli ...``, against a real server
(uvicorn on loopback in this process, its embedded Ray) holding a few finished jobs. Beside
them, measured the same way in the same run, the two yardsticks: the bare interpreter
(``python -c pass``: the floor) and ``python -c "import torch, ray"`` (what every command
paid before they stopped importing both). Printed: min, median and max wall seconds per
command, the median's ratio to the torch-and-Ray import, whether each command imported
torch or Ray, the target (median < 1 s) as met or NOT met, and the machine's load, which
on a shared machine moves these figures a lot.

    .venv/bin/python bench/cli_latency.py [--runs 5] [--jobs 3]
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from small_job import inputs, load, one_job, serve, upload  # noqa: E402 - the same server and job

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 1.0
REPORT = "import atexit, json, sys; atexit.register(lambda: print('HEAVY=' + json.dumps([m for m in ('torch', 'ray') if m in sys.modules]), file=sys.stderr))"


def timed(argv: list[str]) -> tuple[float, int, str]:
    """Wall seconds of one fresh process, its exit code and its stderr."""
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - started, done.returncode, done.stderr


def cli(*args: str) -> list[str]:
    """``bnrecal ARGS`` in a fresh interpreter, reporting at exit whether torch or Ray was imported."""
    return [sys.executable, "-c", f"{REPORT}\nimport sys\nfrom bnrecal.service.cli import main\nmain(sys.argv[1:])", *args]


def measure(argv: list[str], runs: int) -> tuple[list[float], int, list[str]]:
    timed(argv)  # warm-up: the file cache, not counted
    results = [timed(argv) for _ in range(runs)]
    heavy: list[str] = []
    for _, _, err in results:
        for line in err.splitlines():
            if line.startswith("HEAVY="):
                heavy = sorted(set(heavy) | set(json.loads(line.removeprefix("HEAVY="))))
    return [seconds for seconds, _, _ in results], results[-1][1], heavy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timed runs per command (after one warm-up)")
    parser.add_argument("--jobs", type=int, default=3, help="finished jobs on the server for jobs/status")
    args = parser.parse_args()
    print(f"before: {load()}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        checkpoint, data = inputs(folder, 16)
        server, thread, url = serve(folder / "server", 0)
        try:
            with httpx.Client(base_url=url, timeout=120) as client:
                spec = {"arch": "torchvision:resnet18", "model_kwargs": {"num_classes": 10},
                        "checkpoint": upload(client, checkpoint), "data": upload(client, data),
                        "workers": 1, "batch_size": 8}
                job_id = [one_job(client, spec)[1]["id"] for _ in range(args.jobs)][-1]
            server_args = ["--server", url]
            commands = {
                "python -c pass (floor)": [sys.executable, "-c", "pass"],
                "python -c 'import torch, ray'": [sys.executable, "-c", "import torch, ray"],
                "bnrecal --help": cli("--help"),
                f"bnrecal jobs ({args.jobs} jobs)": cli("jobs", *server_args),
                "bnrecal jobs --json": cli("jobs", "--json", *server_args),
                "bnrecal status ID": cli("status", job_id, *server_args),
                "bnrecal cancel ID (finished: exit 1)": cli("cancel", job_id, *server_args),
                "bnrecal delete ID (unknown: exit 2)": cli("delete", "no-such-job", *server_args),
                "bnrecal calibrate --mode async (exit 2)": cli("calibrate", "--mode", "async", "--data", "x.npy",
                                                               "--out", "o.pt"),
            }
            rows = [(name, *measure(argv, args.runs)) for name, argv in commands.items()]
        finally:
            server.should_exit = True
            thread.join(60)
    print(f"after:  {load()}")
    yardstick = statistics.median(rows[1][1])
    print(f"wall seconds of a fresh process, {args.runs} runs each: min / median / max; median vs importing torch and Ray")
    for name, seconds, code, heavy in rows:
        median = statistics.median(seconds)
        imported = f"imports {', '.join(heavy)}" if heavy else "no torch, no Ray"
        print(f"  {name:42s} {min(seconds):5.2f} / {median:5.2f} / {max(seconds):5.2f} s  "
              f"{median / yardstick:4.2f}x  exit {code}  {imported if name.startswith('bnrecal') else ''}")
    commands_median = [statistics.median(seconds) for name, seconds, _, _ in rows if name.startswith("bnrecal")]
    verdict = "met" if max(commands_median) < TARGET_S else "NOT met"
    print(f"target: every command's median < {TARGET_S:g} s: {verdict} (slowest {max(commands_median):.2f} s)")


if __name__ == "__main__":
    main()
