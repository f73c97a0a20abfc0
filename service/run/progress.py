"""The terminal progress display of a run, shared by the command line and the Python API."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from service.run.options import STARTING_PHASE

stderr = Console(stderr=True)


@contextmanager
def progress_bar(description: str) -> Iterator[Any]:
    """A progress bar on a terminal; a silent callback elsewhere (pipes, CI logs)."""
    if not stderr.is_terminal:
        yield lambda done, total, phase=description: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr, transient=False) as bar:
        tasks: dict[str, Any] = {description: bar.add_task(description, total=None)}

        def update(done: int, total: int | None, phase: str = description) -> None:
            if phase not in tasks:  # a new phase gets its own line; the earlier ones are over
                for task in bar.tasks:
                    if not task.finished:
                        bar.update(task.id, total=task.total or 1, completed=task.total or 1)
                tasks[phase] = bar.add_task(phase, total=None)
            # starting workers counts nothing (its total is the samples still to come): no bar yet
            bar.update(tasks[phase], completed=done, total=None if phase == STARTING_PHASE else total)

        yield update
