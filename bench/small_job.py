"""Small-job latency over HTTP: submit -> ``succeeded`` for a 64-sample resnet18 job, cold and warm.

A real server (uvicorn on loopback, in this process, with its embedded Ray instance)
gets a torchvision resnet18 (``num_classes`` 10) checkpoint and 64 samples of 3x32x32;
the same job is then submitted ``--warm`` + 1 times, one after the other. The first
finds no warm actors (the ranks' processes start and import torch); the others reuse
the first job's ranks from the warm pool. Printed: each job's wall time from submit to
``succeeded`` (polled every 20 ms), its calibration pass as the report has it, the
cold/warm ratio, the target (warm <= 3 s) as met or NOT met, and the machine's load,
which on a shared machine moves these figures a lot. ``--idle-s 0`` measures the same
without the pool.

    .venv/bin/python bench/small_job.py [--warm 5] [--workers 2] [--idle-s 60]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
import torch
import uvicorn

TARGET_WARM_S = 3.0


def load() -> str:
    """The machine's load averages over 1, 5 and 15 minutes, and its CPUs."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def inputs(folder: Path, samples: int) -> tuple[Path, Path]:
    """A resnet18 checkpoint (10 classes) and ``samples`` 3x32x32 calibration samples."""
    import torchvision

    torch.manual_seed(0)
    checkpoint = folder / "resnet18.pt"
    torch.save(torchvision.models.resnet18(weights=None, num_classes=10).state_dict(), checkpoint)
    data = folder / "calib.npy"
    np.save(data, np.random.default_rng(0).normal(size=(samples, 3, 32, 32)).astype(np.float32))
    return checkpoint, data


def serve(data_dir: Path, idle_s: float) -> tuple[uvicorn.Server, threading.Thread, str]:
    """A real server on a free loopback port, as ``bnrecal serve`` runs it."""
    from bnrecal.api.app import create_app
    from bnrecal.service.settings import Settings

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = create_app(Settings(data_dir=data_dir, warm_pool_idle_s=idle_s))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 180
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def upload(client: httpx.Client, path: Path) -> str:
    response = client.post(
        "/v1/blobs", content=path.read_bytes(), headers={"Content-Type": "application/octet-stream"},
        params={"filename": path.name},
    )
    response.raise_for_status()
    return response.json()["digest"]


def one_job(client: httpx.Client, spec: dict) -> tuple[float, dict]:
    """Seconds from submit to ``succeeded``, and the finished job."""
    started = time.perf_counter()
    response = client.post("/v1/jobs", json=spec)
    response.raise_for_status()
    job_id = response.json()["id"]
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.02)
    seconds = time.perf_counter() - started
    if job["status"] != "succeeded":
        raise RuntimeError(f"job {job_id} {job['status']}: {job['error']}")
    return seconds, job


def span(job: dict, start: str, stop: str) -> float:
    """Seconds between two of a job's timestamps."""
    return (datetime.fromisoformat(job[stop]) - datetime.fromisoformat(job[start])).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=5, help="warm jobs after the cold one")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--idle-s", type=float, default=60.0, help="BNRECAL_WARM_POOL_IDLE_S (0: no pool)")
    args = parser.parse_args()
    print(f"before: {load()}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        checkpoint, data = inputs(folder, args.samples)
        server, thread, url = serve(folder / "server", args.idle_s)
        try:
            with httpx.Client(base_url=url, timeout=120) as client:
                spec = {
                    "arch": "torchvision:resnet18", "model_kwargs": {"num_classes": 10},
                    "checkpoint": upload(client, checkpoint), "data": upload(client, data),
                    "workers": args.workers, "batch_size": args.batch,
                }
                runs = [one_job(client, spec) for _ in range(args.warm + 1)]
        finally:
            server.should_exit = True
            thread.join(60)
    print(f"after:  {load()}")
    print(f"resnet18, {args.samples} samples 3x32x32, {args.workers} workers, batch {args.batch}, "
          f"warm pool idle {args.idle_s:g} s; submit -> succeeded over HTTP:")
    for i, (seconds, job) in enumerate(runs):
        label = "cold" if i == 0 else f"{'warm' if args.idle_s > 0 else 'again'} {i}"
        queued, running = span(job, "created_at", "started_at"), span(job, "started_at", "finished_at")
        print(f"  {label:7s} {seconds:6.2f} s: queued {queued:.2f} s, running {running:.2f} s "
              f"(calibration pass {job['report']['seconds']:.2f} s)")
    cold = runs[0][0]
    warm = [seconds for seconds, _ in runs[1:]]
    if warm:
        median = statistics.median(warm)
        print(f"cold {cold:.2f} s, {'warm' if args.idle_s > 0 else 'again (no pool)'} median {median:.2f} s (min {min(warm):.2f}, max {max(warm):.2f}): "
              f"cold/warm {cold / median:.1f}x")
        verdict = "met" if median <= TARGET_WARM_S else "NOT met"
        print(f"target warm <= {TARGET_WARM_S:g} s: {verdict}")


if __name__ == "__main__":
    main()
