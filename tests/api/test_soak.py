"""``bench/soak.py`` in small: jobs and concurrent uploads against one real server, with
no 5xx and every job succeeded. The full soak (200 jobs, 50 uploads) and its resource
figures are quoted in the README's benchmarks section."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a server start and 16 jobs: ~1-2 min
def test_small_soak_has_no_errors_and_no_lost_jobs() -> None:
    command = [sys.executable, str(REPO / "bench" / "soak.py"), "--jobs", "12", "--uploads", "20", "--warmup", "4"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    output = run.stdout + run.stderr
    assert "12 jobs, 12 ended" in output and "outcomes {'succeeded': 12}" in output, output[-3000:]
    assert "5xx: 0; jobs not succeeded: 0; errors: []" in output, output[-3000:]
    for figure in ("server_rss MiB", "server_fds", "ray_processes"):
        assert figure in output
