"""A real MLflow tracking server for the tests: ``mlflow server`` from the full ``mlflow``
package, in the venv of its own the Makefile's ``test`` target makes (``.venv-mlflow``: it
pins pyarrow below the project's), with a SQLite backend and served artifacts under a
temporary folder, on a free loopback port, without its job runner; stopped at the end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MLFLOW = REPO / ".venv-mlflow" / "bin" / "mlflow"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def mlflow_server() -> Iterator[str]:
    """Start the server and yield its tracking URI (``http://127.0.0.1:PORT``)."""
    if not MLFLOW.exists():
        pytest.fail(f"no MLflow server at {MLFLOW}: run `make test` (it makes .venv-mlflow) or `make mlflow-server`")
    with tempfile.TemporaryDirectory(prefix="bnrecal-mlflow-server-") as folder:
        port = free_port()
        log = open(Path(folder) / "server.log", "wb")
        process = subprocess.Popen(
            [str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
             "--artifacts-destination", f"{folder}/artifacts", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            # No job runner: MLflow's server starts seven huey consumers for its GenAI jobs, each
            # importing mlflow (about 2.5 CPU-minutes of the suite's run); tracking needs none.
            env={key: value for key, value in os.environ.items() if not key.startswith("MLFLOW_")}
            | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        uri = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"mlflow server did not start: {(Path(folder) / 'server.log').read_text()[-2000:]}")
                time.sleep(0.25)
            yield uri
        finally:
            os.killpg(process.pid, signal.SIGTERM)  # the server and its uvicorn worker
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            log.close()
