"""A rank process's start-up (workers/ranks/process/start_up.py): its collector paused while it
loads and resumed, with start-up frozen, once the rank is built; nothing in any other process."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

from bnrecal.workers.ranks.offload import run_on_ranks
from bnrecal.workers.ranks.plan import GroupOptions
from bnrecal.workers.ranks.process.start_up import RANK_PROCESS

ROOT = Path(__file__).resolve().parents[4]


def collector() -> tuple[bool, int, str | None]:
    """Whether the collector runs in this process, how many objects it froze, and the mark."""
    return gc.isenabled(), gc.get_freeze_count(), os.environ.get(next(iter(RANK_PROCESS)))


def test_a_built_rank_runs_its_collector_with_its_start_up_frozen(warm_pool):
    states = run_on_ranks(collector, [(), ()], 2, "cpu", GroupOptions(cpus_per_worker=1), pool=warm_pool)
    for enabled, frozen, mark in states:
        assert enabled and mark == "1"
        assert frozen > 10_000  # torch's and the engine's objects, out of later collections


def test_importing_the_rank_actor_elsewhere_leaves_the_collector_alone():
    code = "import gc; import bnrecal.workers.ranks.process.actor; print(gc.isenabled(), gc.get_freeze_count())"
    environment = {k: v for k, v in os.environ.items() if k not in RANK_PROCESS}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**environment, "PYTHONPATH": str(ROOT)}, check=True)
    assert done.stdout.split() == ["True", "0"]
