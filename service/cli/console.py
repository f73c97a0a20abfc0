"""What every ``bnrecal`` command shares: the error console, the progress display, and
parsing of the JSON and shape flags (errors name the flag)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from workers.errors import SpecError

stderr = Console(stderr=True)


def parse_json_object(value: str | None, option: str) -> dict[str, Any] | None:
    """Parse a JSON object given on the command line, naming the option when it is not one."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{option} is not valid JSON: {exc.msg} at position {exc.pos}", field=option) from None
    if not isinstance(parsed, dict):
        raise SpecError(f"{option} must be a JSON object, got {type(parsed).__name__}", field=option)
    return parsed


def parse_shape(value: str) -> tuple[int, ...]:
    """Parse ``3,224,224`` into a per-sample shape, naming the option when it is not one."""
    try:
        shape = tuple(int(part) for part in value.replace("x", ",").split(","))
    except ValueError:
        raise SpecError(f"--input-shape must be comma-separated integers, got {value!r}", field="input_shape") from None
    if not shape or min(shape) < 1:
        raise SpecError(f"--input-shape must be positive integers, got {value!r}", field="input_shape")
    return shape


@contextmanager
def progress_bar(description: str) -> Iterator[Any]:
    """A progress bar on a terminal; a silent callback elsewhere (pipes, CI logs)."""
    if not stderr.is_terminal:
        yield lambda done, total: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr, transient=False) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def fail(message: str, code: int) -> NoReturn:
    """Print one error line and exit."""
    stderr.print(f"error: {message}", highlight=False, markup=False, soft_wrap=True)
    raise SystemExit(code)


def print_line(text: str) -> None:
    """One plain line on stderr (no markup, no highlighting)."""
    stderr.print(text, highlight=False)
