"""The report's fields are documented: every field of the typed report (and of its layer,
skipped-layer, convergence and dataset entries) has a row in docs/report.md, so the page
and the object cannot drift apart."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from bnrecal.service.run.report import (
    LAYER_KEYS,
    Convergence,
    DatasetReport,
    Report,
    SkippedLayerReport,
    WorstError,
)

DOCS = Path(__file__).resolve().parents[3] / "docs" / "report.md"


def documented() -> set[str]:
    """Every backquoted name on the page (table rows and the prose that lists sub-fields)."""
    return set(re.findall(r"`([a-z0-9_]+)`", DOCS.read_text()))


@pytest.mark.parametrize("kind", [Report, Convergence, DatasetReport, SkippedLayerReport, WorstError])
def test_every_field_is_on_the_report_page(kind):
    names = {item.name for item in fields(kind)} - {"extra"}
    missing = sorted(names - documented())
    assert missing == [], f"{kind.__name__} fields not in docs/report.md: {missing}"


def row_names() -> set[str]:
    """The names a table row of the page starts with (``| `se_mean_max`, `se_mean_median` |``)."""
    names: set[str] = set()
    for cell in re.findall(r"^\| ([^|]+)\|", DOCS.read_text(), flags=re.M):
        names |= set(re.findall(r"`([a-z0-9_]+)`", cell))
    return names


def test_every_layer_field_has_a_row():
    missing = sorted(set(LAYER_KEYS) - row_names())
    assert missing == [], f"layer fields without a row in docs/report.md: {missing}"


def test_top_level_fields_each_have_a_row():
    missing = sorted({item.name for item in fields(Report)} - {"extra"} - row_names())
    assert missing == [], f"report fields without a row in docs/report.md: {missing}"
