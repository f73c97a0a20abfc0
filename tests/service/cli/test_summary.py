"""The closing lines of ``calibrate`` and ``submit`` say when a pass was retried, and why:
a user whose run succeeded at the second attempt learns that a rank was lost."""

from __future__ import annotations

from pathlib import Path

from bnrecal.service.cli.console import summary_lines


def report(**changes):
    base = {"layers": [{"name": "bn"}], "samples": 64, "world_size": 2, "backend": "gloo", "mode": "sync",
            "seconds": 1.5, "attempts": 1, "retried_failures": []}
    return base | changes


def test_a_first_try_says_nothing_of_retries():
    assert not any("retried" in line for line in summary_lines(report(), Path("out.pt")))


def test_a_retried_run_says_how_often_and_why():
    lines = summary_lines(report(attempts=2, retried_failures=["rank 1 on node ab12 died: killed"]), Path("out.pt"))
    assert "retried 1 time after: rank 1 on node ab12 died: killed" in lines
    lines = summary_lines(report(attempts=3, retried_failures=["a", "b"]), Path("out.pt"))
    assert "retried 2 times after: a; b" in lines
