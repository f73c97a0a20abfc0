"""``bnrecal serve`` as a real process, for the tests that crash, stop and restart it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
KEY = "restart-test-key"


class ServerProcess:
    """``bnrecal serve`` in its own process group, on a data directory that outlives it."""

    def __init__(self, data_dir: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = os.environ | {
            "PYTHONPATH": str(REPO),
            "BNRECAL_MODEL_MODULES": "tests",
            "BNRECAL_API_KEYS": KEY,
            "BNRECAL_COLLECTIVE_TIMEOUT_S": "600",
            "RAY_ADDRESS": "local",  # a fresh embedded Ray of its own, whatever else runs here
        } | (env or {})
        command = [str(Path(sys.executable).parent / "bnrecal"), "serve", "--data-dir", str(data_dir),
                   "--port", str(self.port), "--log-level", "warning"]
        self.log = log.open("ab")
        said_before = self.log.tell()  # a restarted server appends to its predecessor's log
        self.process = subprocess.Popen(command, env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.client = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        deadline = time.monotonic() + 120
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited {self.process.returncode}: {log.read_text()[-3000:]}")
            said_serving = b"bnrecal serving on" in log.read_bytes()[said_before:]
            try:
                if self.client.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                if said_serving:  # the console's "serving on" line comes once the server answers, never before it
                    self.close()
                    raise AssertionError(f"said it was serving before it answered: {log.read_text()[-3000:]}") from None
            if time.monotonic() > deadline:
                self.close()  # not left running when it never got ready (no fixture knows it yet)
                raise AssertionError(f"server did not get ready: {log.read_text()[-3000:]}")
            time.sleep(0.25)

    def crash(self) -> None:
        """SIGKILL the server process, as a crash would."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)
        self.close()

    def close(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        try:  # whatever the server started (its embedded Ray) goes with it
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """The servers a test starts, each stopped (and its Ray with it) when the test ends."""
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.close()


