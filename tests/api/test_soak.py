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


@pytest.mark.slow  # a server start and 10 jobs: ~1 min
def test_small_soak_has_no_errors_and_no_lost_jobs() -> None:
    # 8 jobs outlast a round of the probes (two of them jobs, taking turns with the soak's), with
    # the 20 uploads landing among them; a warm-up of 2 starts the job host and the ranks first.
    command = [sys.executable, str(REPO / "bench" / "soak.py"), "--jobs", "8", "--uploads", "20", "--warmup", "2",
               "--probes"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    output = run.stdout + run.stderr
    assert "8 jobs, 8 ended" in output and "outcomes {'succeeded': 8}" in output, output[-3000:]
    assert "5xx: 0; jobs not succeeded: 0; errors: []" in output, output[-3000:]
    probes = re.search(r"probes: (\d+) sent, (\d+) missed", output)
    assert probes and int(probes.group(1)) >= len(PROBES) and probes.group(2) == "0", output[-3000:]
    assert "results re-read: 10" in output, output[-3000:]  # 8 jobs and 2 of warm-up
    for figure in ("server_rss MiB", "server_fds", "ray_processes"):
        assert figure in output
