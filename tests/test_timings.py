"""The suite's clock (tests/timings.py): the quick tier keeps every test module's cheapest
test by the kept durations, a module not measured yet whole, and never a test measured as
skipped when the module has others."""

from __future__ import annotations

from types import SimpleNamespace

from tests.timings import quick_selection


def items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_the_quick_tier_is_every_modules_cheapest_test_and_new_modules_whole():
    collected = items("tests/a.py::slow", "tests/a.py::cheap", "tests/b.py::skipped", "tests/b.py::other",
                      "tests/new.py::one", "tests/new.py::two", "tests/c.py::renamed")
    kept = {
        "tests/a.py::slow": {"setup": 9.0, "call": 1.0, "outcome": "passed"},
        "tests/a.py::cheap": {"setup": 0.1, "call": 2.0, "outcome": "passed"},
        "tests/b.py::skipped": {"setup": 0.0, "call": 0.0, "outcome": "skipped"},
        "tests/b.py::other": {"setup": 5.0, "call": 5.0, "outcome": "passed"},
        "tests/c.py::gone": {"setup": 1.0, "call": 1.0, "outcome": "passed"},
    }
    selected, deselected = quick_selection(collected, kept)
    assert [item.nodeid for item in selected] == [
        "tests/a.py::cheap", "tests/b.py::other", "tests/new.py::one", "tests/new.py::two", "tests/c.py::renamed",
    ]
    assert [item.nodeid for item in deselected] == ["tests/a.py::slow", "tests/b.py::skipped"]
