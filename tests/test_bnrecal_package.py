"""The public face: ``import bnrecal`` gives the documented names, the same error types the
rest of the product raises, and a help page for ``recalibrate``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import bnrecal
from bnrecal.service.client import BnrecalClient
from bnrecal.workers import errors

ROOT = Path(__file__).resolve().parents[1]


def test_the_public_names_are_the_products_own():
    for name in bnrecal.__all__:
        assert getattr(bnrecal, name).__doc__, f"bnrecal.{name} has no docstring"
    assert bnrecal.BnrecalClient is BnrecalClient
    assert bnrecal.BnrecalError is errors.BnrecalError and bnrecal.NoBatchNormError is errors.NoBatchNormError
    assert issubclass(bnrecal.ModelInputError, bnrecal.BnrecalError)


def test_help_works_in_a_fresh_interpreter():
    done = subprocess.run(
        [sys.executable, "-c", "import bnrecal; help(bnrecal.recalibrate)"], capture_output=True, text=True,
        env={"PYTHONPATH": str(ROOT), "PAGER": "cat", "PATH": "/usr/bin:/bin"}, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "update_bn" in done.stdout and "forward" in done.stdout and "server" in done.stdout
