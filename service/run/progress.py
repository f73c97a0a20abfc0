"""The terminal progress display of a run, shared by the command line and the Python API.

Each phase is a line of its own and counts in its own unit: calibrating and evaluating
count samples, uploading counts bytes, downloading counts files, and a phase that counts
nothing (starting workers, exporting, writing, stopping Ray) shows its elapsed time only,
never a count borrowed from another phase.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

stderr = Console(stderr=True)

PHASE_UNITS = {"calibrating": "samples", "evaluating": "samples", "downloading": "files"}
"""The unit each counting phase counts in; any phase not named here counts nothing."""
BYTES = "bytes"


def phase_unit(phase: str) -> str | None:
    """The unit a phase counts in (``uploading <file>`` counts bytes), or None."""
    if phase.startswith("uploading"):
        return BYTES
    return PHASE_UNITS.get(phase)


def count_text(done: float, total: float | None, unit: str | None) -> str:
    """``12/64 samples``, ``3.1/44.0 MB``, ``1/2 files``; empty for a phase without a count."""
    if unit is None or total is None:
        return ""
    if unit == BYTES:
        scale, name = (2**20, "MiB") if total >= 2**20 else (2**10, "KiB")
        return f"{done / scale:.1f}/{total / scale:.1f} {name}"
    return f"{int(done)}/{int(total)} {unit}"


class _CountColumn(ProgressColumn):
    """The count of a phase in its own unit (nothing for a phase that counts nothing)."""

    def render(self, task: Task) -> Text:
        return Text(count_text(task.completed, task.total, task.fields.get("unit")))


@contextmanager
def progress_bar(description: str) -> Iterator[Any]:
    """A progress display on a terminal; a silent callback elsewhere (pipes, CI logs).

    Yields ``update(done, total, phase)``: a new phase gets its own line (the earlier ones
    are over); a phase that counts nothing (see ``phase_unit``) shows no bar and no count.
    """
    if not stderr.is_terminal:
        yield lambda done, total=None, phase=description: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), _CountColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=False) as bar:
        tasks: dict[str, TaskID] = {}

        def start(phase: str) -> None:
            for task in bar.tasks:  # a new phase: the earlier ones are over
                if not task.finished:
                    bar.update(task.id, total=task.total or 1, completed=task.total or 1)
                    bar.stop_task(task.id)
            tasks[phase] = bar.add_task(phase, total=None, unit=phase_unit(phase))

        def update(done: int, total: int | None = None, phase: str = description) -> None:
            if phase not in tasks:
                start(phase)
            if phase_unit(phase) is None:
                return  # nothing to count: the line shows the phase and its elapsed time
            bar.update(tasks[phase], completed=done, total=total)

        start(description)
        yield update
