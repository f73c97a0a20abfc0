"""stdout carries only a command's own output (docs/cli.md, "Output and exit codes"): a rank
that dies under ``bnrecal calibrate`` makes Ray push its "A worker died..." paragraph to the
driver, which Ray prints on stdout; here it must land on stderr. ``bnrecal`` runs as a real
process with an embedded Ray of its own.

It lives beside the other tests that start a throwaway Ray in a child process while the
session's instance runs (``test_ray_loss.py``): after the command-line tests have started and
stopped embedded instances inside the test process, a child's instance starting crashed the
test process itself (a segfault, seen in two full runs here; its cause is not found yet)."""

from __future__ import annotations

import pytest

from tests.service.cli.test_cli_streams import bnrecal, marker_files  # noqa: F401 - the fixture


@pytest.mark.slow  # a command with an embedded Ray of its own: ~15 s
def test_a_dying_rank_prints_nothing_on_stdout(marker_files, tmp_path):
    checkpoint, data = marker_files
    run = bnrecal("calibrate", "--arch", "tests.nets:marker_net", "--checkpoint", str(checkpoint), "--data", str(data),
                  "--out", str(tmp_path / "o.pt"), "--workers", "2", "--batch-size", "4", "--order", "given")
    assert run.returncode == 1
    assert run.stdout == ""  # before: Ray's "(raylet) A worker died or was killed..." paragraph
    assert "error: rank" in run.stderr and "died" in run.stderr


