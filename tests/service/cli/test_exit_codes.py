"""The command line's exit codes for the error tree: 2 for bad input, 1 for anything else."""

from __future__ import annotations

import bnrecal.errors as errors
from bnrecal.errors import CancelledError, ConflictError, DatasetOptionError, ExportError, RunError, SpecError
from bnrecal.service.cli.console import exit_code


def test_bad_input_exits_2_and_every_other_failure_1():
    assert exit_code(SpecError("x", field="workers")) == 2 and exit_code(DatasetOptionError("x")) == 2
    assert exit_code(ConflictError("already succeeded")) == 2
    assert exit_code(RunError("rank 1 died", rank=1)) == 1 and exit_code(CancelledError("x")) == 1
    assert exit_code(ExportError("x")) == 1 and exit_code(errors.BnrecalError("x")) == 1
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert exit_code(cls("x")) == (2 if issubclass(cls, errors.InputError) else 1), name
