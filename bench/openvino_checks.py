"""OpenVINO's check of exported files: one OpenVINO process reused for every file (what the
product does, ``service/export/openvino_process.py``) against a new Python importing OpenVINO
per file (what it did before), on the same files and batches, in turn, in one run.

    .venv/bin/python bench/openvino_checks.py FILE.onnx [--files 10] [--shape 3,16,16]

Prints the seconds per file both ways and their ratio (target: the reused process well under
the new-Python-per-file baseline; the figures follow the machine, the ratio is what counts).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bnrecal.service.export.openvino_process import _CHILD, OpenVinoProcess


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--files", type=int, default=10)
    parser.add_argument("--shape", default="3,16,16")
    args = parser.parse_args(argv)
    shape = tuple(int(n) for n in args.shape.split(","))
    rng = np.random.default_rng(0)
    batches = {f"b{b}": rng.standard_normal((n, *shape)).astype(np.float32) for b, n in enumerate((1, 8))}
    with tempfile.TemporaryDirectory(prefix="bench-openvino-") as folder:
        Path(folder, "model.onnx").write_bytes(args.model.read_bytes())
        np.savez(Path(folder, "batches.npz"), **batches)
        timings: dict[str, list[float]] = {"new Python per file (before)": [], "one process reused (now)": []}
        reused = OpenVinoProcess()
        for _ in range(args.files):  # in turn, so both meet the same machine
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", _CHILD], input=f"{folder}\n", capture_output=True,
                                  text=True, check=True)
            assert done.stdout.split() == ["ready", "ok"], done.stdout
            timings["new Python per file (before)"].append(time.perf_counter() - started)
            started = time.perf_counter()
            reused.run(Path(folder))
            timings["one process reused (now)"].append(time.perf_counter() - started)
        reused.close()
    print(f"{args.files} checks of {args.model.name} at batches 1 and 8\n")
    print("| how | total s | s a file (median) |\n|---|---:|---:|")
    for how, times in timings.items():
        print(f"| {how} | {sum(times):.2f} | {float(np.median(times)):.3f} |")
    before, now = (sum(times) for times in timings.values())
    print(f"\nratio now / before: {now / before:.2f}x (the first reused check includes its process's start)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
