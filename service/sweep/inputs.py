"""A sweep as the command line gives it (docs/sweeps.md, "`bnrecal sweep`"): a models manifest,
``NAME=PATH`` calibration and evaluation sets, and a pairs file, each read and checked
before any work, every problem a ``SpecError`` naming the flag and the line or set.

This module imports no torch: a bad manifest is refused in the time ``bnrecal --help`` takes.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from bnrecal.errors import SpecError

from bnrecal.service.run.options import check_model_choice

from .cells import CalibrationSet, SweepModel, check_name, unique_names

MANIFEST_KEYS = ("checkpoint", "program", "arch", "model_kwargs", "name")
UNNAMED_SET = "data"
"""The name of the one calibration set a plain ``--data PATH`` gives."""


def read_manifest(path: Path, *, arch: str | None, model_kwargs: dict[str, Any], flag: str = "--models") -> list[SweepModel]:
    """The models a manifest lists, one a line: a checkpoint path (with ``--arch``), a
    ``.pt2`` program path, or a JSON object with ``checkpoint`` or ``program`` and
    optionally ``arch``, ``model_kwargs`` and ``name``. Blank lines and ``#`` comments are
    skipped; a relative path is read from the manifest's folder. A model's name is its
    ``name``, else its file's stem, made unique with ``-2``, ``-3`` ... when stems collide."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{flag} {path}: cannot be read ({exc.__class__.__name__})", field=flag) from None
    lines: list[tuple[str, SweepModel]] = []  # where it stands, the model as its line gives it
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            where = f"{flag} {path} line {number}"
            lines.append((where, _manifest_line(line, where, path.parent, flag)))
    if not lines:
        raise SpecError(f"{flag} {path}: lists no model", field=flag)
    models = []
    for (where, given), name in zip(lines, unique_names([model.name for _, model in lines]), strict=True):
        model = replace(  # the command's --arch and --model-kwargs where the line gives none; a program has its own
            given, name=_line_name(name, where, flag),
            arch=None if given.program else given.arch or arch,
            model_kwargs={} if given.program else given.model_kwargs or model_kwargs,
        )
        try:
            check_model_choice(model.arch, model.checkpoint, model.program, model.model_kwargs, flags=True)
        except SpecError as exc:
            raise SpecError(f"{where}: {exc.message}", field=flag) from None
        models.append(model)
    return models


def _manifest_line(line: str, where: str, folder: Path, flag: str) -> SweepModel:
    """One manifest line as a model: its existing checkpoint or program, its own arch and
    model_kwargs (none on a path line), and its name (its ``name``, else its file's stem)."""
    if line.startswith("{"):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{where}: not a JSON object ({exc.msg})", field=flag) from None
        if not isinstance(entry, dict):
            raise SpecError(f"{where}: not a JSON object", field=flag)
        unknown = sorted(set(entry) - set(MANIFEST_KEYS))
        if unknown:
            raise SpecError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(MANIFEST_KEYS)})", field=flag)
        for key in ("checkpoint", "program", "arch", "name"):
            if key in entry and not isinstance(entry[key], str):
                raise SpecError(f"{where}: {key} must be a string", field=flag)
        if "model_kwargs" in entry and not isinstance(entry["model_kwargs"], dict):
            raise SpecError(f"{where}: model_kwargs must be a JSON object", field=flag)
        if ("checkpoint" in entry) == ("program" in entry):
            raise SpecError(f"{where}: give checkpoint or program (one of them)", field=flag)
    else:
        entry = {"program" if line.lower().endswith(".pt2") else "checkpoint": line}
    key = "program" if "program" in entry else "checkpoint"
    file = Path(entry[key]).expanduser()
    file = file if file.is_absolute() else folder / file
    if not file.is_file():
        raise SpecError(f"{where}: {key} {entry[key]}: no such file", field=flag)
    return SweepModel(
        name=entry.get("name") or file.stem, arch=entry.get("arch"), model_kwargs=entry.get("model_kwargs") or {},
        checkpoint=file if key == "checkpoint" else None, program=file if key == "program" else None,
    )


def _line_name(name: str, where: str, flag: str) -> str:
    try:
        return check_name(name, "model", flag)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc.message}", field=flag) from None


_NAMED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)=(.+)$")


def named_paths(values: list[str], flag: str) -> dict[str, str]:
    """``NAME=PATH`` values as {name: path}, in order; one value without a name is the set
    named ``data``. Names are unique and folder-safe."""
    named: dict[str, str] = {}
    for value in values:
        match = _NAMED.match(value)
        if match is None or "://" in match.group(1):
            if len(values) > 1:
                raise SpecError(f"{flag} {value}: name each set as NAME=PATH when there are several", field=flag)
            name, path = UNNAMED_SET, value
        else:
            name, path = match.group(1), match.group(2)
        check_name(name, "set", flag)
        if name in named:
            raise SpecError(f"{flag}: the set name {name!r} is given twice", field=flag)
        named[name] = path
    if not named:
        raise SpecError(f"give {flag} NAME=PATH (at least one set)", field=flag)
    return named


def calibration_sets(data: list[str], eval_data: list[str]) -> list[tuple[str, str, str | None]]:
    """(name, data, evaluation data) of every set, from ``--data`` and ``--eval-data``; an
    evaluation set's name must be a calibration set's."""
    sets = named_paths(data, "--data")
    evaluations = named_paths(eval_data, "--eval-data") if eval_data else {}
    for name in evaluations:
        if name not in sets:
            raise SpecError(f"--eval-data {name}: no calibration set of that name (sets: {', '.join(sets)})",
                            field="--eval-data")
    return [(name, path, evaluations.get(name)) for name, path in sets.items()]


def read_pairs(path: Path, models: list[str], sets: list[str], flag: str = "--pairs") -> set[tuple[str, str]]:
    """The cells a pairs file lists: one ``MODEL SET`` (or ``MODEL,SET``) a line, by name;
    blank lines and ``#`` comments skipped; a name the sweep does not have names its line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{flag} {path}: cannot be read ({exc.__class__.__name__})", field=flag) from None
    pairs: set[tuple[str, str]] = set()
    known_models, known_sets = set(models), set(sets)
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [part.strip() for part in re.split(r"[,\s]+", line) if part.strip()]
        where = f"{flag} {path} line {number}"
        if len(parts) != 2:
            raise SpecError(f"{where}: give MODEL SET (two names), got {line!r}", field=flag)
        model, set_name = parts
        if model not in known_models:
            raise SpecError(f"{where}: no model named {model!r}", field=flag)
        if set_name not in known_sets:
            raise SpecError(f"{where}: no set named {set_name!r} (sets: {', '.join(sets)})", field=flag)
        pairs.add((model, set_name))
    if not pairs:
        raise SpecError(f"{flag} {path}: lists no pair", field=flag)
    return pairs


def as_sets(sets: list[tuple[str, Any, Any]]) -> list[CalibrationSet]:
    """The sets as typed objects (their paths as the data flags give them)."""
    return [CalibrationSet(name, data, evaluation) for name, data, evaluation in sets]
