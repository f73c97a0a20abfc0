"""The public face: ``import bnrecal`` gives the documented names, the same error types the
rest of the product raises, and a help page for ``recalibrate``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import bnrecal
from bnrecal.service.client import BnrecalClient
from bnrecal.service.jobserver.records.views import JobView
import bnrecal.errors as errors

ROOT = Path(__file__).resolve().parents[1]


def test_the_public_names_are_the_products_own():
    for name in bnrecal.__all__:
        assert getattr(bnrecal, name).__doc__, f"bnrecal.{name} has no docstring"
    assert bnrecal.BnrecalClient is BnrecalClient
    assert bnrecal.JobView is JobView and bnrecal.JobStatus.succeeded.is_terminal  # what its job calls return
    assert bnrecal.BnrecalError is errors.BnrecalError and bnrecal.NoBatchNormError is errors.NoBatchNormError
    assert issubclass(bnrecal.ModelInputError, bnrecal.BnrecalError)
    for name in errors.__all__:  # the whole tree, by the names bnrecal.errors gives it
        assert getattr(bnrecal, name) is getattr(errors, name) and name in bnrecal.__all__


def test_the_error_names_load_without_torch_in_a_fresh_interpreter():
    """Catching ``bnrecal.SpecError`` costs nothing: the error tree imports nothing of ours."""
    probe = (
        "import sys, bnrecal; bnrecal.SpecError; bnrecal.RunError; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'numpy') "
        "or m.startswith(('bnrecal.service', 'bnrecal.api'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_import_bnrecal_never_loads_an_integration():
    """Lightning and MLflow are extras: the Python API's names load neither (bnrecal.lightning
    and bnrecal.mlflow do)."""
    probe = ("import sys, bnrecal; bnrecal.recalibrate; bnrecal.RecalibrationOptions; bnrecal.recalibrate_many; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'mlflow')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_help_works_in_a_fresh_interpreter():
    done = subprocess.run(
        [sys.executable, "-c", "import bnrecal; help(bnrecal.recalibrate)"], capture_output=True, text=True,
        env={"PYTHONPATH": str(ROOT), "PAGER": "cat", "PATH": "/usr/bin:/bin"}, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "update_bn" in done.stdout and "forward" in done.stdout and "server" in done.stdout
