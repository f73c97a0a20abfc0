"""Chaos: jobs submitted while their ranks are killed at random, and once the server itself;
no job may be lost and none may end wrong.

Starts ``bnrecal serve`` as a process of its own (fresh data dir, embedded Ray,
``BNRECAL_MAX_RETRIES=1``), runs one clean job first (its checkpoint is the reference: the
same data, order and workers always give the same statistics), then submits ``--jobs`` more
of the same job, ``--concurrency`` in flight at a time, each with an ``Idempotency-Key`` and
retried until the server accepts it (through 503s, refused connections and the restart).
Meanwhile a chaos thread SIGKILLs a random rank process (``ray::CalibrationRank``) of the
server's Ray every ``--kill-every`` seconds on average, and once, when half the jobs are
submitted, SIGKILLs the server with its whole Ray and starts it again on the same data dir.

At the end every job is classified from the server's ledger:

- **succeeded**, its checkpoint downloaded (the download verified against its digest) and
  its BN statistics compared with the reference: **wrong** when any differs by more than
  ``1e-5`` (relative);
- **failed with a clear reason**: an ``error`` whose type is a known problem (not the
  catch-all ``bnrecal``/``internal``) and whose ``detail`` says what happened;
- **failed unclearly**: any other failure;
- **lost**: a job the server accepted that it no longer knows, or that never ended.

Prints the figures and exits 1 when anything was lost, wrong or failed unclearly.

    .venv/bin/python bench/chaos.py [--jobs 24] [--concurrency 2] [--kill-every 6] [--seed 0]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import psutil
import torch

import servers  # bench/servers.py, beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.nets import mixed_net, perturbed  # noqa: E402 - the repo's own test nets

KEY = "chaos-tenant"
TERMINAL = ("succeeded", "failed", "cancelled")
UNCLEAR_TYPES = ("https://bnrecal.dev/problems/bnrecal", "https://bnrecal.dev/problems/internal")
TOLERANCE = 1e-5


def start_server(data_dir: Path, log: Path, port: int) -> subprocess.Popen[bytes]:
    """``bnrecal serve`` with one retry per failed pass, appending to ``log`` when started again."""
    return servers.start_server(data_dir, log, port, {
        "BNRECAL_API_KEYS": KEY, "BNRECAL_MAX_RETRIES": "1", "BNRECAL_COLLECTIVE_TIMEOUT_S": "60",
        "BNRECAL_MIN_FREE_BYTES": "0",
    }, append=True)


def kill_session(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the server and everything it started (its embedded Ray), as a crash would."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(30)


def rank_processes(root: int) -> list[psutil.Process]:
    """The server's live rank actors."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []
    ranks = []
    for child in children:
        try:
            if child.name().startswith("ray::CalibrationRank"):
                ranks.append(child)
        except psutil.Error:
            continue
    return ranks


def bn_statistics(checkpoint: bytes) -> dict[str, torch.Tensor]:
    state = torch.load(io.BytesIO(checkpoint), weights_only=True)
    return {name: value for name, value in state.items() if name.endswith(("running_mean", "running_var"))}


def differs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest relative difference of any BN statistic (inf for a missing one)."""
    worst = 0.0
    for name, value in want.items():
        if name not in got:
            return float("inf")
        scale = value.abs().clamp_min(1e-6)
        worst = max(worst, float(((got[name] - value).abs() / scale).max()))
    return worst


@dataclass
class Chaos:
    """The server, the jobs it accepted, and what was done to it."""

    url: str
    data_dir: Path
    log: Path
    port: int
    process: subprocess.Popen[bytes]
    spec: dict
    accepted: dict[int, str] = field(default_factory=dict)  # job index -> id
    ranks_killed: int = 0
    server_kills: int = 0
    refused: Counter = field(default_factory=Counter)  # what a submission met before it was accepted
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)

    def submit(self, index: int, give_up_s: float = 600) -> str | None:
        """Submit job ``index`` until the server accepts it (the same key: never two jobs)."""
        deadline = time.monotonic() + give_up_s
        with self.client() as client:
            while time.monotonic() < deadline:
                try:
                    response = client.post("/v1/jobs", json=self.spec, headers={"Idempotency-Key": f"chaos-{index}"})
                except httpx.TransportError as exc:
                    self.refused[type(exc).__name__] += 1
                    time.sleep(1)
                    continue
                if response.status_code == 202:
                    with self.lock:
                        self.accepted[index] = response.json()["id"]
                    return response.json()["id"]
                self.refused[str(response.status_code)] += 1
                time.sleep(float(response.headers.get("retry-after", "1")))
        return None

    def wait(self, job_id: str, timeout: float = 900) -> dict | None:
        """Poll a job to its end (through the restart); None if it never ends or is unknown."""
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while time.monotonic() < deadline:
                try:
                    response = client.get(f"/v1/jobs/{job_id}")
                except httpx.TransportError:
                    time.sleep(1)
                    continue
                if response.status_code == 404:
                    return None
                job = response.json()
                if job.get("status") in TERMINAL:
                    return job
                time.sleep(0.5)
        return None

    def restart(self) -> None:
        """SIGKILL the server and its Ray, and start it again on the same data dir and port."""
        kill_session(self.process)
        self.server_kills += 1
        self.process = start_server(self.data_dir, self.log, self.port)

    def kill_ranks(self, stop: threading.Event, every_s: float, rng: random.Random) -> None:
        while not stop.wait(rng.uniform(0.5, 1.5) * every_s):
            ranks = rank_processes(self.process.pid)
            if ranks:
                try:
                    rng.choice(ranks).kill()
                    self.ranks_killed += 1
                except psutil.Error:
                    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=6.0, help="seconds between rank kills, on average")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="bnrecal-chaos-"))
    torch.manual_seed(0)
    model, samples = perturbed(mixed_net()), torch.randn(96, 3, 6, 5) * 1.5 + 0.3
    checkpoint, data = workdir / "m.pt", workdir / "x.npy"
    torch.save(model.state_dict(), checkpoint)
    np.save(data, samples.numpy())
    port = servers.free_port()
    log = workdir / "server.log"
    process = start_server(workdir / "data", log, port)
    chaos = Chaos(f"http://127.0.0.1:{port}", workdir / "data", log, port, process, spec={})
    try:
        with chaos.client() as client:
            digests = {name: client.post("/v1/blobs", content=path.read_bytes()).json()["digest"]
                       for name, path in (("checkpoint", checkpoint), ("data", data))}
        chaos.spec = {"arch": "tests.nets:mixed_net", "workers": 2, "batch_size": 8, "order": "given", **digests}
        began = time.monotonic()
        reference_id = chaos.submit(-1)
        reference = chaos.wait(reference_id) if reference_id else None
        if reference is None or reference["status"] != "succeeded":
            raise SystemExit(f"the clean reference job did not succeed: {reference}")
        with chaos.client() as client:
            want = bn_statistics(client.get(f"/v1/jobs/{reference_id}/artifacts/checkpoint").content)
        print(f"reference job {reference_id} in {time.monotonic() - began:.1f} s; chaos begins", flush=True)

        stop = threading.Event()
        killer = threading.Thread(target=chaos.kill_ranks, args=(stop, args.kill_every, rng), daemon=True)
        killer.start()
        outcomes: dict[int, dict | None] = {}
        began = time.monotonic()

        def run(index: int) -> None:
            job_id = chaos.submit(index)
            outcomes[index] = chaos.wait(job_id) if job_id else None

        threads: list[threading.Thread] = []
        restarter: threading.Thread | None = None
        for index in range(args.jobs):
            while sum(thread.is_alive() for thread in threads) >= args.concurrency:
                time.sleep(0.2)
            if index == args.jobs // 2 and restarter is None:
                print(f"killing the server (and its Ray) after {index} jobs submitted", flush=True)
                restarter = threading.Thread(target=chaos.restart, daemon=True)  # submissions go on meanwhile
                restarter.start()
            thread = threading.Thread(target=run, args=(index,), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        if restarter is not None:
            restarter.join()
        stop.set()
        seconds = time.monotonic() - began

        figures = Counter()
        unclear, wrong = [], []
        reasons: dict[str, str] = {}  # problem type -> the first detail seen
        with chaos.client() as client:
            for index in range(args.jobs):
                job = outcomes.get(index)
                if index not in chaos.accepted:
                    figures["never accepted"] += 1
                    continue
                figures["submitted"] += 1
                if job is None:
                    figures["lost"] += 1
                    continue
                if job["status"] == "succeeded":
                    figures["succeeded"] += 1
                    try:
                        got = bn_statistics(client.get(f"/v1/jobs/{job['id']}/artifacts/checkpoint").content)
                        gap = differs(got, want)
                    except Exception as exc:  # noqa: BLE001 - a download that breaks is counted, not fatal
                        gap = float("inf")
                        print(f"job {job['id']}: checkpoint unreadable: {exc}")
                    if gap > TOLERANCE:
                        figures["wrong"] += 1
                        wrong.append((job["id"], gap))
                    if job.get("report", {}).get("retried_failures"):
                        figures["succeeded after a retry"] += 1
                    if job.get("attempts", 1) > 1:
                        figures["succeeded after the restart"] += 1
                    continue
                error = job.get("error") or {}
                if error.get("type") and error["type"] not in UNCLEAR_TYPES and error.get("detail"):
                    figures["failed with a clear reason"] += 1
                    figures[f"  {error['type'].rsplit('/', 1)[-1]}"] += 1
                    reasons.setdefault(error["type"].rsplit("/", 1)[-1], error["detail"])
                else:
                    figures["failed unclearly"] += 1
                    unclear.append((job["id"], error))
    finally:
        kill_session(chaos.process)
    print(f"\n{args.jobs} jobs in {seconds:.0f} s; {chaos.ranks_killed} rank processes killed, "
          f"server killed {chaos.server_kills}x; submissions retried through: {dict(chaos.refused)}")
    for name in ("submitted", "succeeded", "succeeded after a retry", "succeeded after the restart",
                 "failed with a clear reason"):
        print(f"{name:>32}: {figures[name]}")
    for name in sorted(key for key in figures if key.startswith("  ")):
        print(f"{name:>32}: {figures[name]}")
    for name in ("failed unclearly", "lost", "wrong", "never accepted"):
        print(f"{name:>32}: {figures[name]}")
    for kind, detail in reasons.items():
        print(f"e.g. {kind}: {detail[:300]}")
    for job_id, error in unclear:
        print(f"unclear: {job_id}: {error}")
    for job_id, gap in wrong:
        print(f"wrong: {job_id}: BN statistics off by {gap:.3g} (relative)")
    shutil.rmtree(workdir, ignore_errors=True)
    bad = figures["lost"] + figures["wrong"] + figures["failed unclearly"] + figures["never accepted"]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
