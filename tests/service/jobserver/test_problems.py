"""The HTTP face of the error tree: every class of ``bnrecal.errors`` has its own status and
title, the most specific class wins, the problem ``type`` names the class, and no error
class lives outside the one tree."""

from __future__ import annotations

import ast
from pathlib import Path

import bnrecal.errors as errors
from bnrecal.errors import (
    BnrecalError,
    DatasetError,
    DatasetOptionError,
    InputError,
    ModelInputError,
    QuotaExceededError,
    RunError,
    SpecError,
)
from bnrecal.service.client import error_from_problem
from bnrecal.service.jobserver.problems import PROBLEM_KINDS, http_status, problem_kind, problem_of, problem_type

ROOT = Path(__file__).resolve().parents[3]


def test_every_class_of_the_tree_has_its_own_status_and_title():
    """A class added to ``bnrecal.errors`` without a row here would silently answer with
    its parent's status: the table must name it."""
    listed = {getattr(errors, name) for name in errors.__all__}
    assert all(isinstance(cls, type) and issubclass(cls, BnrecalError) for cls in listed)
    missing = sorted(cls.__name__ for cls in listed if cls not in PROBLEM_KINDS)
    assert missing == [], f"no HTTP status for {missing} in PROBLEM_KINDS"
    assert set(PROBLEM_KINDS) == listed, "PROBLEM_KINDS names a class bnrecal.errors does not list"
    assert all(400 <= kind.status < 600 and kind.title for kind in PROBLEM_KINDS.values())


def test_every_subclass_of_the_tree_is_listed_by_it():
    """Each error class, wherever it would be defined, is one of ``bnrecal.errors.__all__``."""
    pending, seen = [BnrecalError], set()
    while pending:
        cls = pending.pop()
        seen.add(cls)
        pending.extend(cls.__subclasses__())
    assert {cls.__name__ for cls in seen} <= set(errors.__all__)


def test_no_error_class_is_defined_outside_the_tree():
    """The source defines no class on top of an error of the tree anywhere but ``bnrecal/errors.py``."""
    names = set(errors.__all__)
    outside, read = [], 0
    for folder in ("api", "bnrecal", "service", "workers"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "bnrecal" / "errors.py":
                continue
            read += 1
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                bases = {getattr(base, "id", getattr(base, "attr", None)) for base in getattr(node, "bases", ())}
                if isinstance(node, ast.ClassDef) and bases & names:
                    outside.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert read > 100, f"read {read} modules under {ROOT}"
    assert outside == [], "define error classes in bnrecal/errors.py:\n" + "\n".join(outside)


def test_the_most_specific_class_wins():
    assert http_status(BnrecalError("x")) == 500 and http_status(InputError("x")) == 400
    assert http_status(SpecError("x")) == 422 and http_status(RunError("x")) == 500
    assert problem_kind(QuotaExceededError).title == "Storage quota exceeded"
    assert http_status(QuotaExceededError) == 413
    # a DatasetError first, a SpecError second: the data's row, as a class attribute would resolve
    assert problem_kind(DatasetOptionError) == problem_kind(DatasetError)

    class LocalInputError(ModelInputError):  # a class the table does not name takes its nearest ancestor's row
        pass

    assert problem_kind(LocalInputError) == problem_kind(ModelInputError)


def test_the_problem_type_names_the_class_and_comes_back_as_it():
    assert problem_type(SpecError) == "https://bnrecal.dev/problems/spec"
    assert problem_type(ModelInputError("x")) == "https://bnrecal.dev/problems/model-input"
    assert problem_type(BnrecalError) == "https://bnrecal.dev/problems/bnrecal"
    for name in errors.__all__:
        cls = getattr(errors, name)
        error = cls("the message")
        problem = problem_of(error)
        assert problem.status == http_status(cls) and problem.detail == "the message"
        assert type(error_from_problem(problem)) is cls, name


def test_a_run_failure_says_where_and_an_input_error_names_its_field():
    assert problem_of(RunError("rank 1 died", rank=1, node="n1")).body() == {
        "type": "https://bnrecal.dev/problems/run", "title": "Calibration run failed", "status": 500,
        "detail": "rank 1 died", "rank": 1, "node": "n1",
    }
    assert problem_of(SpecError("workers must be >= 1", field="workers")).field == "workers"
    assert problem_of(DatasetError("empty")).field == "data"
