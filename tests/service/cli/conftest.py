"""What the command-line tests share: the environment a command runs in."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def cli_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The test models allowed (``--arch tests.nets:...``), the state under ``tmp_path``, and
    errors as users see them (one line and an exit code, never a traceback)."""
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    monkeypatch.setenv("BNRECAL_DATA_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("BNRECAL_DEBUG", raising=False)
