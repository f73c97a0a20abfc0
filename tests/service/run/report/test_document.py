"""The report's schema is documented: every field of every typed part of the report (walked
from ``Report`` through each section's models) has its JSON key on the page that describes
that part, so the pages and the objects cannot drift apart; the top level's and a layer's
fields each have a table row of docs/report.md."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from bnrecal.service.export import report_sections
from bnrecal.service.report_part import ReportPart
from bnrecal.service.run.report import document as run_report
from bnrecal.service.run.report.document import LayerReport, Report

DOCS = Path(__file__).resolve().parents[4] / "docs"

PAGE: dict[str, str] = {}  # a part described on a page of its own, by class name (none: all are on report.md)


def parts(kind: type[BaseModel] = Report, seen: set[type] | None = None) -> set[type[ReportPart]]:
    """Every ReportPart reachable from ``kind`` through its fields' types."""
    seen = set() if seen is None else seen
    if kind in seen:
        return seen
    seen.add(kind)
    for field in kind.model_fields.values():
        for inner in _classes(field.annotation):
            if isinstance(inner, type) and issubclass(inner, ReportPart):
                parts(inner, seen)
    return seen


def _classes(annotation: object) -> list[object]:
    found = [annotation]
    for argument in typing.get_args(annotation):
        found += _classes(argument)
    return found


def keys(kind: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in kind.model_fields.items()}


def documented(page: str) -> set[str]:
    """Every backquoted name on the page (table rows and the prose that lists sub-fields)."""
    text = (DOCS / page).read_text()
    return set(re.findall(r"`([a-z0-9_]+)`", text)) | set(re.findall(r'"([a-z0-9_]+)"', text))


def test_the_walk_reaches_every_section():
    names = {kind.__name__ for kind in parts()}
    assert {"OnnxSection", "Int8Section", "Int8Guard", "EvaluationSection", "JobSection", "DataSummary",
            "ModelSection", "ProgramSection", "RuntimeEntry", "LayerReport", "Convergence"} <= names
    defined = {
        obj.__name__ for module in (report_sections, run_report) for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, ReportPart) and obj.__module__ == module.__name__
    }
    assert defined - names == set(), "report parts no report holds"


@pytest.mark.parametrize("kind", sorted(parts(), key=lambda kind: kind.__name__), ids=lambda kind: kind.__name__)
def test_every_field_is_on_its_page(kind):
    page = PAGE.get(kind.__name__, "report.md")
    missing = sorted(keys(kind) - documented(page))
    assert missing == [], f"{kind.__name__} fields not in docs/{page}: {missing}"


def row_names() -> set[str]:
    """The names a table row of the page starts with (``| `se_mean_max`, `se_mean_median` |``)."""
    names: set[str] = set()
    for cell in re.findall(r"^\| ([^|]+)\|", (DOCS / "report.md").read_text(), flags=re.M):
        names |= set(re.findall(r"`([a-z0-9_]+)`", cell))
    return names


@pytest.mark.parametrize("kind", [Report, LayerReport])
def test_top_level_and_layer_fields_each_have_a_row(kind):
    missing = sorted(keys(kind) - row_names())
    assert missing == [], f"{kind.__name__} fields without a row in docs/report.md: {missing}"
