"""The terminal progress display counts each phase in its own unit (issue 33): samples while
calibrating, bytes while uploading, files while downloading, nothing while exporting."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from bnrecal.service.run import progress
from bnrecal.service.run.progress import count_text, phase_unit, progress_bar


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    screen = io.StringIO()
    monkeypatch.setattr(progress, "stderr", Console(file=screen, force_terminal=True, width=100))
    return screen


def lines_of(screen: io.StringIO) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", screen.getvalue())
    last: dict[str, str] = {}
    for line in text.replace("\r", "\n").splitlines():
        if line.strip():
            last[line.split()[0]] = line  # each phase's line as last drawn
    return list(last.values())


def test_each_phase_counts_in_its_own_unit(terminal):
    with progress_bar("starting workers") as update:
        update(0, 360, "starting workers")
        update(360, 360, "calibrating")
        update(0, None, "exporting")
        update(0, None, "writing")
        update(1, 2, "downloading")
        update(2, 2, "downloading")
    shown = {line.split()[0]: line for line in lines_of(terminal)}
    assert "360/360 samples" in shown["calibrating"]
    assert "2/2 files" in shown["downloading"]
    for phase in ("starting", "exporting", "writing"):
        assert "/" not in shown[phase], shown[phase]  # no count borrowed from another phase


def test_uploads_count_bytes(terminal):
    with progress_bar("uploading model.pt") as update:
        update(3 * 2**20, 44 * 2**20, "uploading model.pt")
    assert "3.0/44.0 MiB" in lines_of(terminal)[0]


def test_units():
    assert phase_unit("calibrating") == phase_unit("evaluating") == "samples"
    assert phase_unit("uploading calib.npy") == "bytes" and phase_unit("exporting") is None
    assert count_text(5, 64, "samples") == "5/64 samples" and count_text(1, None, None) == ""
    assert count_text(512, 2048, "bytes") == "0.5/2.0 KiB"
