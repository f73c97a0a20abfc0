"""The job commands against a real server: ``jobs``, ``status``, ``cancel``, and Ctrl-C on
``submit`` (a real SIGINT to a real ``bnrecal`` process)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.api.conftest import KEYS, submit, upload, wait_for, write_samples
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("ray_cluster")

KEY = KEYS["cli"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, stale_checkpoint) -> tuple[Path, Path]:
    data, _ = write_samples(tmp_path_factory.mktemp("cli-jobs") / "x.npy", 12)
    return stale_checkpoint(), data


def job_spec(live_server, inputs: tuple[Path, Path], arch: str) -> dict:
    checkpoint, data = inputs
    with live_server.client("cli") as client:
        return {"arch": arch, "checkpoint": upload(client, checkpoint), "data": upload(client, data),
                "workers": 1, "batch_size": 4}


def test_jobs_status_and_cancel(live_server, inputs, capsys):
    server = ["--server", live_server.url, "--api-key", KEY]
    with live_server.client("cli") as client:
        done = submit(client, job_spec(live_server, inputs, "tests.nets:mixed_net"))
        wait_for(client, done["id"], ("succeeded",))
        hanging = submit(client, job_spec(live_server, inputs, "tests.nets:slow_start_net"))
        wait_for(client, hanging["id"], ("running",))

    code, rows, _ = run_cli(capsys, "jobs", *server)
    assert code == 0
    header, *rows = rows.splitlines()
    assert header.startswith("ID") and "STATUS" in header and "CREATED" in header
    assert rows[0].split()[:3] == [hanging["id"], "running", "starting"] and "starting workers" in rows[0]  # newest first
    assert rows[1].split()[:2] == [done["id"], "succeeded"] and "tests.nets:mixed_net" in rows[1]

    code, status, _ = run_cli(capsys, "status", done["id"], *server)
    assert code == 0 and f"job {done['id']}: succeeded" in status
    assert "recalibrated 5 BN layers on 12 samples" in status and "artifacts: checkpoint, report, report.html" in status
    code, status, _ = run_cli(capsys, "status", hanging["id"], *server)
    assert code == 0 and "progress: starting workers" in status

    code, _, err = run_cli(capsys, "cancel", hanging["id"], *server)
    assert code == 0 and err.strip() == f"job {hanging['id']} cancelled on {live_server.url}"
    with live_server.client("cli") as client:
        assert wait_for(client, hanging["id"], ("cancelled",), timeout=10)["status"] == "cancelled"
    code, _, err = run_cli(capsys, "cancel", hanging["id"], *server)
    assert code == 1 and err.strip() == f"job {hanging['id']} already cancelled; nothing to cancel"
    code, _, err = run_cli(capsys, "status", "no-such-job", *server)
    assert code == 2 and err.count("\n") == 1 and "no-such-job" in err


def test_ctrl_c_on_submit_cancels_the_job_and_exits_130(live_server, inputs, tmp_path):
    checkpoint, data = inputs
    command = [
        sys.executable, "-m", "bnrecal.service.cli", "submit", "--server", live_server.url, "--api-key", KEY,
        "--arch", "tests.nets:slow_start_net", "--checkpoint", str(checkpoint), "--data", str(data),
        "--workers", "1", "--batch-size", "4", "--out", str(tmp_path / "out.pt"),
    ]
    env = {**os.environ, "BNRECAL_DEBUG": "0"}
    # A suite started in the background (``make test &``) has SIGINT ignored, and a child
    # inherits that: Ctrl-C would never reach the command. Give it the default, as a terminal does.
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # The job's id is submit's one line on stdout; Ctrl-C once that job runs (other tests' jobs
    # of this tenant may run on the shared server too).
    ready, _, _ = select.select([process.stdout], [], [], 60)
    assert ready and process.poll() is None, process.communicate()
    job_id = process.stdout.readline().strip()
    with live_server.client("cli") as client:
        deadline = time.monotonic() + 60
        while client.get(f"/v1/jobs/{job_id}").json()["status"] != "running":
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
        assert process.returncode == 130, err
        assert err.strip().splitlines()[-1] == f"error: interrupted: job {job_id} cancelled on {live_server.url}"
        assert wait_for(client, job_id, ("cancelled",), timeout=10)["status"] == "cancelled"
    assert not (tmp_path / "out.pt").exists()
