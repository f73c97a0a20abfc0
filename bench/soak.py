"""Soak: many small jobs and concurrent uploads against one server; nothing may leak.

Starts ``bnrecal serve`` as a process of its own (fresh data dir, embedded Ray) and,
after a warm-up of a few jobs, runs:

- ``--jobs`` small jobs (``tests.nets:mixed_net`` on 32 samples, one worker, checkpoint
  and report), ``--concurrency`` submitted at a time, each polled to its end;
- meanwhile ``--uploads`` uploads of 1 MiB of random bytes, all at once;
- with ``--probes``, meanwhile and until the jobs end, the abuse tests' requests (tests/api/abuse.py)
  (``tests/api/abuse.py``: a model of 10^7 classes, 1024 workers, non-UTF-8 and 5,000-deep
  JSON, a 1 MB header, a compression bomb, NaN data, ...) from a second tenant, over and
  over, each of which must get its 4xx (or fail its job fast as bad input).

At the end every succeeded job's checkpoint is downloaded again and must be byte-identical
to what it was when the job ended.

Every second it samples the server process (RSS, open files, threads) and the Ray
processes it started (its session: GCS, raylet, workers; summed, with their count).
It prints the figures after warm-up, halfway and at the end, their growth from warm-up
and over the second half, and counts the 5xx answers, the jobs that did not succeed and
the jobs still not finished when the run ends. Exit status 1 when any of those counts is
not zero or a figure grew over the second half past ``--max-growth`` (RSS, as a
fraction) or 16 (open files, threads): a leak keeps growing, while Ray's worker pool
fills up once at the start.

    .venv/bin/python bench/soak.py [--jobs 200] [--uploads 50] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch

import servers  # bench/servers.py, beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.api.abuse import PROBES, check, upload_blobs  # noqa: E402 - the abuse tests' probes
from tests.nets import mixed_net, perturbed  # noqa: E402 - the repo's own test nets

TERMINAL = ("succeeded", "failed", "cancelled")
SOAK_KEY, PROBE_KEY = "soak-tenant", "probe-tenant"
FD_THREAD_SLACK = 16


@dataclass
class Sample:
    """Resources at one moment: the server's, and its Ray processes' summed."""

    at: float
    server_rss: int
    server_fds: int
    server_threads: int
    ray_rss: int
    ray_fds: int
    ray_threads: int
    ray_processes: int


def proc_status(pid: int) -> tuple[int, int, int]:
    """RSS bytes, open file descriptors and threads of a process (zeros once it is gone)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        return 0, 0, 0
    if "VmRSS" not in fields:  # a zombie: exited, not yet reaped
        return 0, 0, 0
    return int(fields["VmRSS"].split()[0]) * 1024, fds, int(fields["Threads"])


def session_members(session: int) -> list[int]:
    """Processes in a session (the server started its Ray there)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == session:  # after state, ppid, pgrp: the session id
            members.append(int(entry))
    return members


def sample(server_pid: int) -> Sample:
    """The server's resources and its Ray processes' (everything else in its session)."""
    rss, fds, threads = proc_status(server_pid)
    others = [proc_status(pid) for pid in session_members(server_pid) if pid != server_pid]
    others = [figures for figures in others if figures[0]]
    return Sample(
        time.monotonic(), rss, fds, threads,
        sum(f[0] for f in others), sum(f[1] for f in others), sum(f[2] for f in others), len(others),
    )


def start_server(data_dir: Path, log: Path, port: int) -> subprocess.Popen[bytes]:
    """``bnrecal serve`` with the soak's two keys."""
    return servers.start_server(data_dir, log, port, {"BNRECAL_API_KEYS": f"{SOAK_KEY},{PROBE_KEY}"})


class Soak:
    """The load, and what it saw: status codes, each job's end, the resource samples."""

    def __init__(self, url: str, server_pid: int, workdir: Path) -> None:
        self.codes: Counter[int] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._server_pid = server_pid
        self._http = httpx.Client(base_url=url, timeout=120, event_hooks={"response": [self._count]},
                                  limits=httpx.Limits(max_connections=64),
                                  headers={"Authorization": f"Bearer {SOAK_KEY}"})
        self._url = url
        self.results: dict[str, str] = {}
        self.probes_sent = 0
        self.probes_failed: list[str] = []
        torch.manual_seed(0)
        model = perturbed(mixed_net())
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        self.checkpoint = self.upload(buffer.getvalue())
        data = io.BytesIO()
        np.save(data, np.random.default_rng(0).normal(size=(32, 3, 6, 5)).astype(np.float32))
        self.data = self.upload(data.getvalue())

    def _count(self, response: httpx.Response) -> None:
        with self._lock:
            self.codes[response.status_code] += 1

    def upload(self, body: bytes) -> str:
        response = self._http.post("/v1/blobs", content=body, headers={"Content-Type": "application/octet-stream"})
        response.raise_for_status()
        return response.json()["digest"]

    def job(self, index: int) -> None:
        """Submit one job and poll it to its end; record how it ended."""
        spec = {"arch": "tests.nets:mixed_net", "checkpoint": self.checkpoint, "data": self.data,
                "workers": 1, "batch_size": 8 + index % 3}
        try:
            job = self._http.post("/v1/jobs", json=spec).raise_for_status().json()
            deadline = time.monotonic() + 300
            while job["status"] not in TERMINAL and time.monotonic() < deadline:
                time.sleep(0.1)
                job = self._http.get(f"/v1/jobs/{job['id']}").raise_for_status().json()
            if job["status"] == "succeeded":
                body = self._http.get(f"/v1/jobs/{job['id']}/artifacts/checkpoint").raise_for_status().content
                self.results[job["id"]] = hashlib.sha256(body).hexdigest()
            outcome = job["status"] if job["status"] in TERMINAL else "stuck"
        except httpx.HTTPError as exc:
            outcome = "error"
            self.errors.append(f"job {index}: {exc}")
        with self._lock:
            self.outcomes[outcome] += 1

    def upload_random(self, index: int) -> None:
        try:
            self.upload(os.urandom(1024 * 1024))
        except httpx.HTTPError as exc:
            self.errors.append(f"upload {index}: {exc}")

    def probe(self, stop: threading.Event) -> None:
        """Replay the abusive probes as another tenant until ``stop``; count what misses."""
        with httpx.Client(base_url=self._url, timeout=120, event_hooks={"response": [self._count]},
                          headers={"Authorization": f"Bearer {PROBE_KEY}"}) as client:
            checkpoint = io.BytesIO()
            torch.save(perturbed(mixed_net()).state_dict(), checkpoint)
            data = io.BytesIO()
            np.save(data, np.random.default_rng(1).normal(size=(16, 3, 6, 5)).astype(np.float32))
            blobs = upload_blobs(client, checkpoint.getvalue(), data.getvalue())
            while not stop.is_set():
                for probe in PROBES:
                    if stop.is_set():
                        return
                    try:
                        failure = check(probe, client, blobs)
                    except httpx.HTTPError as exc:
                        failure = f"{probe.name}: {exc}"
                    with self._lock:
                        self.probes_sent += 1
                        if failure:
                            self.probes_failed.append(failure)

    def verify_results(self) -> None:
        """Every succeeded job's checkpoint, downloaded again, as it was when the job ended."""
        for job_id, digest in self.results.items():
            body = self._http.get(f"/v1/jobs/{job_id}/artifacts/checkpoint").content
            if hashlib.sha256(body).hexdigest() != digest:
                self.errors.append(f"job {job_id}: its checkpoint changed")

    def watch(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.samples.append(sample(self._server_pid))
            stop.wait(1.0)


def mean_of(samples: list[Sample], name: str) -> float:
    return sum(getattr(s, name) for s in samples) / max(1, len(samples))


def report(soak: Soak, warm: list[Sample], seconds: float, jobs: int, max_growth: float) -> bool:
    """Print the figures; whether the soak passed."""
    quarter = max(1, len(soak.samples) // 4)
    start, middle, end = warm, soak.samples[len(soak.samples) // 2 :][:quarter], soak.samples[-quarter:]
    print(f"{jobs} jobs, {sum(soak.outcomes.values())} ended, in {seconds:.0f} s "
          f"({jobs / seconds:.2f} jobs/s); outcomes {dict(soak.outcomes)}")
    print(f"HTTP answers {dict(sorted(soak.codes.items()))}")
    print(f"{'':16}{'after warm-up':>15}{'halfway':>12}{'end':>12}{'max':>12}{'growth':>10}{'2nd half':>10}")
    passed = True
    for name, unit in [("server_rss", "MiB"), ("server_fds", ""), ("server_threads", ""),
                       ("ray_rss", "MiB"), ("ray_fds", ""), ("ray_threads", ""), ("ray_processes", "")]:
        scale = 1024 * 1024 if unit else 1
        first, half, last = (mean_of(group, name) / scale for group in (start, middle, end))
        peak = max(getattr(s, name) for s in soak.samples) / scale
        growth = (last - first) / first if unit and first else last - first
        late = (last - half) / half if unit and half else last - half
        shown = [f"{g:+.1%}" if unit else f"{g:+.0f}" for g in (growth, late)]
        print(f"{name + (' ' + unit if unit else ''):16}{first:15.1f}{half:12.1f}{last:12.1f}{peak:12.1f}"
              f"{shown[0]:>10}{shown[1]:>10}")
        if (unit and late > max_growth) or (not unit and late > FD_THREAD_SLACK):
            passed = False  # judged on the second half: start-up (Ray's worker pool filling) is not a leak
    server_errors = sum(count for code, count in soak.codes.items() if code >= 500)
    not_succeeded = sum(count for outcome, count in soak.outcomes.items() if outcome != "succeeded")
    print(f"5xx: {server_errors}; jobs not succeeded: {not_succeeded}; errors: {soak.errors[:3]}")
    print(f"probes: {soak.probes_sent} sent, {len(soak.probes_failed)} missed their answer {soak.probes_failed[:3]}; "
          f"results re-read: {len(soak.results)}")
    return passed and not server_errors and not not_succeeded and not soak.errors and not soak.probes_failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--uploads", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max-growth", type=float, default=0.25, help="Largest RSS growth, as a fraction.")
    parser.add_argument("--probes", action="store_true", help="Replay the abuse tests' requests (tests/api/abuse.py) meanwhile.")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bnrecal-soak-"))
    port = servers.free_port()
    server = start_server(workdir / "data", workdir / "server.log", port)
    try:
        soak = Soak(f"http://127.0.0.1:{port}", server.pid, workdir)
        for index in range(args.warmup):
            soak.job(-1 - index)
        warm = [sample(server.pid) for _ in range(3)]
        soak.outcomes.clear()
        stop = threading.Event()
        watcher = threading.Thread(target=soak.watch, args=(stop,), daemon=True)
        watcher.start()
        probes_done = threading.Event()
        prober = threading.Thread(target=soak.probe, args=(probes_done,), daemon=True)
        if args.probes:
            prober.start()
        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as job_pool, ThreadPoolExecutor(max(1, args.uploads)) as uploads:
            pending = [job_pool.submit(soak.job, index) for index in range(args.jobs)]
            time.sleep(2.0)  # the uploads land while jobs run
            pending += [uploads.submit(soak.upload_random, index) for index in range(args.uploads)]
            for future in pending:
                future.result()
        seconds = time.monotonic() - started
        probes_done.set()
        if args.probes:
            prober.join()
        soak.verify_results()
        stop.set()
        watcher.join()
        passed = report(soak, warm, seconds, args.jobs, args.max_growth)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(workdir, ignore_errors=True)
    print("soak passed" if passed else "soak FAILED")
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
