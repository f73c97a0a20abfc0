"""The progress bar: on a terminal a bar per phase up to every sample; nothing with
``progress=False``. The script runs in a fresh process on a pseudo-terminal, with a Ray
it started itself, which the calls leave running."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import sys
import torch
from torch.utils.data import DataLoader, TensorDataset
import ray
import bnrecal
from bnrecal.service.run.cluster import ensure_ray
from tests.nets import mixed_net

ensure_ray(None)  # the caller's own Ray: both calls use it, and it stays up

loader = DataLoader(TensorDataset(torch.randn(40, 3, 6, 6)), batch_size=8)
print("quiet:", flush=True)
bnrecal.recalibrate(mixed_net(), loader, progress=False)
print("shown:", flush=True)
bnrecal.recalibrate(mixed_net(), loader)
print("end", ray.is_initialized(), flush=True)
"""


def test_a_bar_on_a_terminal_and_none_when_asked(tmp_path):
    script = tmp_path / "bar.py"
    script.write_text(SCRIPT)
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm", "COLUMNS": "100"}
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen([sys.executable, str(script)], stdout=follower, stderr=follower, env=env, cwd=tmp_path)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=300) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", b"".join(chunks).decode(errors="replace"))
    quiet, shown = text.split("quiet:")[1].split("shown:")
    assert "calibrating" not in quiet and "starting workers" not in quiet
    assert "starting workers" in shown and re.search(r"calibrating\s+━+ 40/40", shown)
    assert "end True" in shown
