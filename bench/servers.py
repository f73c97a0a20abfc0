"""A real ``bnrecal serve`` for the benches that drive one over HTTP (``soak.py``, ``chaos.py``):
in a process session of its own (so a bench can kill it with its embedded Ray, as a crash
would), ready when ``/readyz`` says so."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(data_dir: Path, log: Path, port: int, settings: dict[str, str], *, append: bool = False) -> subprocess.Popen[bytes]:
    """``bnrecal serve`` on ``port`` with the test models allowed, an embedded Ray and
    ``settings`` (environment variables) on top; its output goes to ``log`` (appended to
    with ``append``, for a server started again)."""
    env = os.environ | {"PYTHONPATH": str(REPO), "BNRECAL_MODEL_MODULES": "tests", "RAY_ADDRESS": "local",
                        "BNRECAL_CPUS_PER_WORKER": "1"} | settings
    bnrecal = Path(sys.executable).parent / "bnrecal"
    process = subprocess.Popen(
        [str(bnrecal), "serve", "--data-dir", str(data_dir), "--port", str(port), "--log-level", "warning"],
        env=env, cwd=REPO, stdout=log.open("ab" if append else "wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not get ready in 180 s")
