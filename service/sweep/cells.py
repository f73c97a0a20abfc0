"""What a sweep is made of (docs/sweeps.md): its models, its named calibration sets, and its
cells (a model and a set each), with the state and result of a cell.

A sweep's models come one at a time (a manifest of hundreds, a generator of subnets): the
cells are made as each model comes (:func:`cells_of`), model by model, every set (or the
listed pairs) for each, so nothing holds every model at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from bnrecal.errors import SpecError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""A model's or a set's name: a folder name on every system (letters, digits, ``._-``)."""


def check_name(name: str, what: str, field_name: str) -> str:
    """``name`` when it can name a folder of the sweep's output, else a ``SpecError``."""
    if not NAME.match(name) or name in (".", ".."):
        raise SpecError(
            f"{what} name {name!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
            field=field_name,
        )
    return name


@dataclass(frozen=True)
class SweepModel:
    """One model of a sweep, as files: an architecture with a checkpoint, or a program."""

    name: str
    arch: str | None = None
    checkpoint: Path | None = None
    program: Path | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)  # free-form: the model factory's own keywords
    source_name: str | None = None  # what its file is called where the path does not say (an upload's name)


@dataclass(frozen=True)
class CalibrationSet:
    """One named calibration set, with its optional evaluation data."""

    name: str
    data: Path | str
    eval_data: Path | str | None = None
    data_name: str | None = None  # what the data is called where the path does not say (an upload's name)
    eval_data_name: str | None = None
    eval_max_samples: int | None = None  # the set's own limit on its evaluation data (else the sweep's)


@dataclass(frozen=True)
class Cell:
    """One model over one set: the single job a sweep runs for them."""

    model_index: int
    model_name: str
    set_name: str

    @property
    def key(self) -> str:
        """``<model name>/<set name>``: where its files land under the sweep's folder."""
        return f"{self.model_name}/{self.set_name}"


class CellStatus(str, Enum):
    """Where a cell is: ``pending`` until it runs, then one of the terminal states."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """Whether the cell is over."""
        return self in (CellStatus.SUCCEEDED, CellStatus.FAILED, CellStatus.CANCELLED)


@dataclass(frozen=True)
class SweepFiles:
    """A sweep of files: its models, its named sets, and the pairs to run (None: all)."""

    models: list[SweepModel]
    sets: list[CalibrationSet]
    pairs: set[tuple[str, str]] | None = None

    def cells(self) -> Iterator[Cell]:
        """The cells, model by model."""
        return cells_of(((i, m.name) for i, m in enumerate(self.models)), [s.name for s in self.sets], self.pairs)


def cells_of(models: Iterable[tuple[int, str]], sets: list[str], pairs: set[tuple[str, str]] | None) -> Iterator[Cell]:
    """The sweep's cells, model by model as ``models`` yields (index, name): each model over
    every set, or over the sets ``pairs`` lists for it (in the sets' order)."""
    for index, name in models:
        for set_name in sets:
            if pairs is None or (name, set_name) in pairs:
                yield Cell(index, name, set_name)


def unique_names(stems: list[str]) -> list[str]:
    """Names for models whose stems may collide: a stem used before gets ``-2``, ``-3``, ...
    (in the order given), never a name another model has."""
    taken, used, names = set(stems), set(), []
    for stem in stems:
        name, count = stem, 2
        while name in used:
            name = f"{stem}-{count}"
            count += 1
            if name in taken:
                name = stem  # another model's own name: go on counting
        used.add(name)
        names.append(name)
    return names
