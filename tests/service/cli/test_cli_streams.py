"""stdout carries only a command's own output, and every path a command takes is checked
before any work: ``bnrecal`` as a real process. A rank that dies under ``calibrate`` makes Ray
push its "A worker died..." paragraph to the driver, which Ray prints on stdout: here it must
land on stderr. A retried run says so. A missing or unwritable path is exit 2, one line
naming the flag and the path, before torch or Ray is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.nets import MARKER, marker_net

REPO = Path(__file__).resolve().parents[3]
BNRECAL = str(Path(sys.executable).parent / "bnrecal")


def bnrecal(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(REPO), "BNRECAL_MODEL_MODULES": "tests", "RAY_ADDRESS": ""}
    return subprocess.run([BNRECAL, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


@pytest.fixture
def marker_files(tmp_path: Path) -> tuple[Path, Path]:
    samples = torch.randn(40, 4)
    samples[9, 0] = MARKER  # the rank that meets it dies (os._exit)
    np.save(tmp_path / "x.npy", samples.numpy())
    torch.save(marker_net().state_dict(), tmp_path / "m.pt")
    return tmp_path / "m.pt", tmp_path / "x.npy"


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--checkpoint", "nope.pt", "--checkpoint nope.pt: no such file or directory"),
        ("--data", "missing/x.npy", "--data missing/x.npy: no such file or directory"),
        ("--eval-data", "gone.npz", "--eval-data gone.npz: no such file or directory"),
        ("--out", "no-such-folder/o.pt", "--out no-such-folder/o.pt: its folder no-such-folder does not exist"),
        ("--report", "no-such-folder/r.json", "--report no-such-folder/r.json: its folder no-such-folder does not exist"),
    ],
)
def test_a_bad_path_is_exit_2_naming_the_flag_and_the_path_before_any_work(marker_files, tmp_path, flag, value, says):
    checkpoint, data = marker_files
    args = {"--arch": "tests.nets:marker_net", "--checkpoint": str(checkpoint), "--data": str(data),
            "--out": str(tmp_path / "o.pt")}
    args[flag] = value
    run = bnrecal("calibrate", *[part for pair in args.items() for part in pair], timeout=60)
    assert run.returncode == 2, run.stderr  # before: exit 1, "internal error: FileNotFoundError"
    assert run.stderr.strip() == f"error: {says}" and run.stdout == ""


def test_an_unreadable_input_is_exit_2(marker_files, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    checkpoint, data = marker_files
    checkpoint.chmod(0)
    run = bnrecal("calibrate", "--arch", "tests.nets:marker_net", "--checkpoint", str(checkpoint), "--data", str(data),
                  "--out", str(tmp_path / "o.pt"), timeout=60)
    assert run.returncode == 2 and "--checkpoint" in run.stderr and "cannot be read" in run.stderr


def test_submit_checks_its_paths_before_it_connects(marker_files, tmp_path):
    checkpoint, data = marker_files
    run = bnrecal("submit", "--server", "http://127.0.0.1:9", "--arch", "tests.nets:marker_net", "--checkpoint",
                  str(checkpoint), "--data", str(data), "--out", str(tmp_path / "o.pt"), "--onnx", "nowhere/m.onnx",
                  timeout=60)
    assert run.returncode == 2 and run.stderr.strip() == "error: --onnx nowhere/m.onnx: its folder nowhere does not exist"
