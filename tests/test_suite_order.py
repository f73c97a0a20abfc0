"""The suite's schedule (tests/conftest.py): the modules it starts first exist, so a move or
a rename does not silently put a long module back at the end of a worker's run."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_started_first_exists() -> None:
    missing = [path for path in LONGEST_FIRST if not (ROOT / path).is_file()]
    assert missing == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
