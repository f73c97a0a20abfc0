"""The cycle collector over a job command's start-up (service/cli/collector.py): paused by the
``bnrecal`` script, resumed at the job's first phase with start-up frozen, resumed before any
other command runs, and never touched by ``main`` called from Python."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bnrecal.service.cli import collector
from tests.conftest import run_cli, save_array, save_state
from tests.nets import mixed_net, perturbed

ROOT = Path(__file__).resolve().parents[3]

# The real entry point; at exit (SystemExit included) the collector's state, on stderr's last line.
SCRIPT = """
import atexit, gc, sys
atexit.register(lambda: sys.stderr.write(f"\\nCOLLECTOR {gc.isenabled()} {gc.get_freeze_count()}\\n"))
from bnrecal.service.cli import script
script()
"""


def run_script(*args: str) -> tuple[int, str, bool, int]:
    """``bnrecal ARGS`` as the installed script runs it: exit code, stderr, and at its exit
    whether the collector ran and how many objects start-up froze."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "BNRECAL_MODEL_MODULES": "tests"}
    environment.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True,
                          env=environment, cwd=ROOT, timeout=120)
    err, _, state = done.stderr.rpartition("COLLECTOR ")
    enabled, frozen = state.split()
    return done.returncode, err, enabled == "True", int(frozen)


@pytest.fixture
def job(tmp_path: Path) -> list[str]:
    """A one-worker calibrate job's flags (no Ray), on a small test net."""
    torch.manual_seed(0)
    model = perturbed(mixed_net())
    return ["calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(save_state(tmp_path / "m.pt", model)),
            "--data", str(save_array(tmp_path / "x.npy", torch.randn(16, 3, 6, 5).numpy())),
            "--batch-size", "8", "--workers", "1", "--out", str(tmp_path / "out.pt")]


def test_a_job_command_resumes_the_collector_at_its_first_phase_with_its_start_up_frozen(job):
    code, err, enabled, frozen = run_script(*job)
    assert code == 0, err
    assert enabled and frozen > 10_000  # torch's and the pipeline's objects, out of later collections


def test_a_job_refused_before_it_starts_exits_as_before(tmp_path):
    code, err, _, _ = run_script("calibrate", "--arch", "nope", "--checkpoint", "x", "--data", "y", "--out", "z")
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_any_other_command_resumes_it_before_it_runs(tmp_path):
    (tmp_path / "state" / "blobs").mkdir(parents=True)  # a data directory no server has used yet
    code, err, enabled, _ = run_script("gc", "--data-dir", str(tmp_path / "state"))
    assert code == 0, err
    assert enabled


def test_progress_before_the_first_phase_keeps_it_paused_and_the_first_phase_resumes_it():
    seen: list[tuple[str, bool]] = []
    update = collector.resumed_at_first_phase(lambda done, total, phase: seen.append((phase, gc.isenabled())))
    collector.pause()
    try:
        update(0, 16, "starting workers")
        update(0, 16, "starting workers again after: rank 1 died")
        update(8, 16, "calibrating")
        update(16, 16, "calibrating")
    finally:
        collector.resume()
        gc.unfreeze()
        gc.enable()
    assert seen == [("starting workers", False), ("starting workers again after: rank 1 died", False),
                    ("calibrating", True), ("calibrating", True)]


def test_main_called_from_python_leaves_the_collector_as_it_was(job, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    monkeypatch.setenv("BNRECAL_DATA_DIR", str(tmp_path / "state"))
    frozen = gc.get_freeze_count()
    code, _, err = run_cli(capsys, *job)
    assert code == 0, err
    assert gc.isenabled() and gc.get_freeze_count() == frozen
