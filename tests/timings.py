"""The suite's clock (docs/development.md): every run keeps each test's seconds, and the quick
tier (``make check``) is chosen from them.

- Each run writes ``test-artifacts/durations.json``: per test, the seconds of its setup, call
  and teardown (module fixtures, such as a server or warm ranks, count in the setup of the
  module's first test), with the run's wall time, so a slow test or a slower suite is seen
  from one run to the next. Under xdist the controller, which receives every report, writes it.
- ``--quick`` keeps, of every test module, its cheapest test by ``tests/durations.json`` (a
  whole run's file, kept in the repository and renewed with ``make durations``), and every
  test of a module that file does not know yet (a new module is checked whole until measured).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WRITTEN = ROOT / "test-artifacts" / "durations.json"
KEPT = Path(__file__).resolve().parent / "durations.json"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true", default=False,
                     help="the quick tier: every test module's cheapest test (tests/durations.json)")


class _Clock:
    """Each test's phases' seconds, as the reports arrive."""

    def __init__(self) -> None:
        self.started = time.time()
        self.tests: dict[str, dict[str, float]] = {}
        self.outcomes: dict[str, str] = {}

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tests.setdefault(report.nodeid, {})[report.when] = round(report.duration, 3)
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.tests:
            return
        WRITTEN.parent.mkdir(parents=True, exist_ok=True)
        total = sum(sum(phases.values()) for phases in self.tests.values())
        WRITTEN.write_text(json.dumps({
            "wall_s": round(time.time() - self.started, 1), "tests_s": round(total, 1), "tests": len(self.tests),
            "durations": {node: {**phases, "outcome": self.outcomes.get(node, "passed")}
                          for node, phases in sorted(self.tests.items())},
        }, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) keeps the clock
        config.pluginmanager.register(_Clock(), "bnrecal-clock")


def quick_selection(items: list[pytest.Item], kept: dict[str, dict]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """Of every module, the test with the fewest seconds (setup and call) in ``kept``; every
    test of a module ``kept`` does not know. Returns (selected, deselected)."""
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    chosen: set[str] = set()
    for module, tests in by_module.items():
        known = [item for item in tests if item.nodeid in kept and kept[item.nodeid].get("outcome") != "skipped"]
        if not any(node.split("::", 1)[0] == module for node in kept):
            chosen.update(item.nodeid for item in tests)
        elif known:
            chosen.add(min(known, key=lambda item: kept[item.nodeid].get("setup", 0) + kept[item.nodeid].get("call", 0)).nodeid)
        else:
            chosen.add(tests[0].nodeid)
    return [item for item in items if item.nodeid in chosen], [item for item in items if item.nodeid not in chosen]


def select_quick(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--quick``, leave the quick tier selected and the rest deselected."""
    if not config.getoption("quick"):
        return
    kept = json.loads(KEPT.read_text())["durations"] if KEPT.exists() else {}
    selected, deselected = quick_selection(items, kept)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
