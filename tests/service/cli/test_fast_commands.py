"""The commands that need no model answer without importing torch or Ray (issue 33): `--help`,
the job commands and every argument error, each run as a user runs it, in a fresh process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "ray", "numpy")

# Runs the real entry point (the installed script's) and, at exit (after SystemExit too),
# reports which heavy modules the process imported, on a line of its own on stderr.
WRAPPER = """
import atexit, json, sys
atexit.register(lambda: sys.stderr.write("\\nIMPORTED " + json.dumps([m for m in HEAVY if m in sys.modules]) + "\\n"))
from bnrecal.service.cli import script
script()
"""


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_fresh(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str, list[str]]:
    """``bnrecal ARGS`` in a new interpreter: exit code, stdout, stderr (less the report), heavy modules."""
    code = f"HEAVY = {HEAVY!r}\n{WRAPPER}"
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    environment.pop("BNRECAL_SERVER", None)
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=environment,
                          cwd=ROOT, timeout=60)
    err, _, report = done.stderr.rpartition("IMPORTED ")
    return done.returncode, done.stdout, err.rstrip("\n"), json.loads(report)


@pytest.mark.parametrize("args", [
    ["--help"], [], ["calibrate", "--help"], ["submit", "--help"], ["jobs", "--help"], ["status", "--help"],
    ["export", "--help"], ["serve", "--help"], ["sweep", "--help"],
])
def test_help_imports_neither_torch_nor_ray(args):
    code, out, _, imported = run_fresh(*args)
    assert code == 0 and "Usage:" in out
    assert imported == []


def test_version_is_the_installed_packages_and_imports_nothing_heavy():
    from importlib import metadata

    code, out, _, imported = run_fresh("--version")
    assert (code, out, imported) == (0, f"bnrecal {metadata.version('bnrecal')}\n", [])


@pytest.mark.parametrize("args, message", [
    (["calibrate", "--mode", "async", "--data", "x.npy", "--out", "o.pt"], "--mode"),
    (["calibrate", "--data", "x.npy"], "--out"),
    (["submit", "--server", "http://x", "--data", "x.npy", "--out", "o.pt", "--workers", "two"], "--workers"),
    (["calibrate", "--arch", "torchvision:resnet18", "--model-kwargs", "{oops", "--checkpoint", "c.pt",
      "--data", "x.npy", "--out", "o.pt"], "--model-kwargs"),
    (["calibrate", "--arch", "torchvision:resnet18", "--data", "x.npy", "--out", "o.pt"], "--checkpoint"),
    (["submit", "--server", "http://x", "--arch", "torchvision:resnet18", "--checkpoint", "missing.pt",
      "--data", "x.npy", "--out", "o.pt"], "missing.pt"),
    (["export", "--arch", "torchvision:resnet18", "--checkpoint", "c.pt", "--out", "m.onnx", "--input-shape", "3,x"],
     "--input-shape"),
    (["nonsense"], "nonsense"),
])
def test_argument_errors_are_one_line_exit_2_without_torch(args, message):
    code, _, err, imported = run_fresh(*args)
    assert code == 2, err
    assert err.count("\n") == 0 and err.startswith("error: ") and message in err
    assert imported == []


@pytest.mark.parametrize("command", [["jobs"], ["jobs", "--json"], ["status", "abc"], ["cancel", "abc"], ["delete", "abc"]])
def test_job_commands_import_neither_torch_nor_ray(command):
    url = f"http://127.0.0.1:{closed_port()}"
    code, _, err, imported = run_fresh(*command, "--server", url)
    assert code == 1 and f"cannot reach the bnrecal server at {url}" in err and err.count("\n") == 0
    assert imported == []
