"""What the command-line tests share: the environment a command runs in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def cli_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The test models allowed (``--arch tests.nets:...``), the state under ``tmp_path``, and
    errors as users see them (one line and an exit code, never a traceback)."""
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    monkeypatch.setenv("BNRECAL_DATA_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("BNRECAL_DEBUG", raising=False)


@pytest.fixture
def cli_warm_ranks(warm_pool: Any) -> Iterator[Any]:
    """Commands run in this test take their Ray ranks from the test run's warm pool
    (``workers.ranks.gangs.warm_context.warm_ranks``), as a process running many jobs in a row
    would: a command on two ranks pays their start-up once per run, not once per command.
    Not for tests about starting, losing or killing ranks."""
    from bnrecal.workers.ranks.gangs.warm_context import warm_ranks

    with warm_ranks(warm_pool):
        yield warm_pool
