"""``bench/soak.py`` in small: jobs, concurrent uploads and issue 21's abusive probes from a
second tenant against one real server, with no 5xx, every job succeeded, every probe
answered as it must be and every result intact. The full soak (200 jobs, 50 uploads) and its resource
figures are quoted in docs/benchmarks.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.abuse import PROBES

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a server start and 16 jobs: ~1-2 min
def test_small_soak_has_no_errors_and_no_lost_jobs() -> None:
    command = [sys.executable, str(REPO / "bench" / "soak.py"), "--jobs", "12", "--uploads", "20", "--warmup", "4",
               "--probes"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    output = run.stdout + run.stderr
    assert "12 jobs, 12 ended" in output and "outcomes {'succeeded': 12}" in output, output[-3000:]
    assert "5xx: 0; jobs not succeeded: 0; errors: []" in output, output[-3000:]
    probes = re.search(r"probes: (\d+) sent, (\d+) missed", output)
    assert probes and int(probes.group(1)) >= len(PROBES) and probes.group(2) == "0", output[-3000:]
    assert "results re-read: 16" in output, output[-3000:]  # 12 jobs and 4 of warm-up
    for figure in ("server_rss MiB", "server_fds", "ray_processes"):
        assert figure in output
