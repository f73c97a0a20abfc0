"""The benches (bench/) import what they measure from bnrecal inside their functions, so a
move or a rename breaks one silently until someone runs it: every bnrecal name a bench
imports must exist (bench/int8.py imported two that had gone)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
IMPORT = re.compile(r"^\s*from (bnrecal[\w.]*) import \(?([\w,\s]+?)\)?\s*$", re.M)


def bench_imports() -> list[tuple[str, str, str]]:
    found = []
    for path in sorted(BENCH.glob("*.py")):
        for match in IMPORT.finditer(path.read_text()):
            for name in (part.strip() for part in match.group(2).split(",")):
                if name:
                    found.append((path.name, match.group(1), name.split(" as ")[0]))
    return found


@pytest.mark.parametrize(("bench", "module", "name"), bench_imports())
def test_every_bnrecal_name_a_bench_imports_exists(bench: str, module: str, name: str) -> None:
    imported = importlib.import_module(module)
    if not hasattr(imported, name):
        importlib.import_module(f"{module}.{name}")  # a submodule: ModuleNotFoundError names it


def test_the_benches_import_something() -> None:
    assert len(bench_imports()) > 20
