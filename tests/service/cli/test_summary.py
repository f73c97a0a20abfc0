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


def test_the_standard_error_is_said_with_its_meaning_as_on_the_web_page():
    """The console, the HTML report and the job page say what "statistics +-x%" means beside
    it, in the same words (the page's script holds the same sentence)."""
    from bnrecal.service.cli.console import statistics_line
    from bnrecal.service.run.report.page import STANDARD_ERROR_MEANING

    worst = {"layer": "layer3.0.bn1", "statistic": "variance", "error": 0.059}
    line = statistics_line(report(standard_error_max=worst, samples=1437, order="shuffled", seed=0))
    assert line == ("statistics +-5.9%, the standard error of 1,437 samples: about how far more data of the same "
                    "kind would move them (worst: layer3.0.bn1, variance +-5.9%; order shuffled, seed 0)")
    script = (Path(__file__).resolve().parents[3] / "api" / "static" / "format.js").read_text()
    assert f'export const STANDARD_ERROR_MEANING = "{STANDARD_ERROR_MEANING}";' in script
