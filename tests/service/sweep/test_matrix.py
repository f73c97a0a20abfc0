"""The matrix report: the cells in brief from their reports, the ranking, CSV and HTML."""

from __future__ import annotations

import csv
import io
import json

import pytest

from bnrecal.errors import SpecError
from bnrecal.service.sweep.cells import Cell, CellStatus
from bnrecal.service.sweep.matrix import CellSummary, SweepReport, check_metric, write_sweep_report


def _cell(model: str, index: int, set_name: str, top1: float | None, status: CellStatus = CellStatus.SUCCEEDED):
    summary = CellSummary.of(Cell(index, model, set_name), status, None, 1.5,
                             error=None if status is CellStatus.SUCCEEDED else "no BatchNorm layer",
                             link=f"{model}/{set_name}/report.html" if top1 is not None else None)
    summary.after_top1, summary.samples = top1, 10 if top1 is not None else None
    return summary


def _report() -> SweepReport:
    return SweepReport(models=["m0", "m1"], sets=["cam1", "cam2"], rank_by="after_top1", workers=2, cells=[
        _cell("m0", 0, "cam1", 0.5), _cell("m0", 0, "cam2", 0.9),
        _cell("m1", 1, "cam1", None, CellStatus.FAILED), _cell("m1", 1, "cam2", 0.7),
    ])


def test_ranking_best_first_and_failed_cells_unranked(tmp_path):
    report = _report()
    write_sweep_report(report, tmp_path)
    assert report.ranking == ["m0/cam2", "m1/cam2", "m0/cam1"]
    assert (report.succeeded, report.failed) == (3, 1)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["ranking"] == report.ranking and saved["cells"][2]["error"] == "no BatchNorm layer"
    assert saved["cells"][0]["set"] == "cam1" and "error" not in saved["cells"][0]


def test_csv_is_one_row_a_cell_ready_for_pandas(tmp_path):
    report = _report()
    write_sweep_report(report, tmp_path)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "sweep.csv").read_text())))
    assert [(r["model"], r["set"], r["status"], r["rank"]) for r in rows] == [
        ("m0", "cam1", "succeeded", "3"), ("m0", "cam2", "succeeded", "1"), ("m1", "cam1", "failed", ""),
        ("m1", "cam2", "succeeded", "2")]
    assert float(rows[1]["after_top1"]) == 0.9 and rows[2]["after_top1"] == "" and rows[2]["error"]


def test_html_heatmap_links_each_cell_and_colours_best_green(tmp_path):
    report = _report()
    write_sweep_report(report, tmp_path)
    page = (tmp_path / "sweep.html").read_text()
    heatmap = page[page.index('id="heatmap-table"'):page.index('id="ranking"')]
    assert heatmap.count('href="') == 3 and 'href="m0/cam2/report.html"' in heatmap
    assert "hsl(120, 70%, 80%)" in heatmap and "hsl(0, 70%, 80%)" in heatmap  # 0.9 best, 0.5 worst
    assert 'title="no BatchNorm layer"' in heatmap
    assert "<script" not in page and "http" not in page


def _ranking_header(page: str) -> list[str]:
    table = page[page.index('id="ranking-table"'):]
    header = table[:table.index("</tr>")]
    return [cell.split("</th>")[0] for cell in header.split("<th>")[1:]]


def test_the_ranking_shows_its_metric_once_and_says_why_top1_columns_are_missing(tmp_path):
    """Ranked by drift, the drift column is the metric's, not repeated; without evaluation
    data the top-1 columns would be blank, so they are left out and the page says why; a
    sweep of arrays decoded nothing and says so instead of 'samples decoded 0'."""
    report = SweepReport(models=["m0"], sets=["cam1", "cam2"], rank_by="worst_drift", workers=1,
                         decoding={"decoded": 0, "reused": 0, "kept_bytes": 0, "spilled_bytes": 0, "not_kept": 0,
                                   "memory_budget_bytes": 0, "disk_budget_bytes": 0}, cells=[
                             _cell("m0", 0, "cam1", None), _cell("m0", 0, "cam2", None)])
    for cell, drift in zip(report.cells, (0.3, 0.1)):
        cell.worst_drift, cell.link = drift, f"{cell.model}/{cell.set_name}/report.html"
    write_sweep_report(report, tmp_path)
    page = (tmp_path / "sweep.html").read_text()
    assert _ranking_header(page) == ["#", "model", "set", "worst drift (std)", "samples", "seconds"]
    assert "No top-1 before or top-1 after or INT8 top-1 column: no cell measured it" in page
    assert "Samples decoded 0" not in page and "No set needed decoding" in page
    with_top1 = _report()
    write_sweep_report(with_top1, tmp_path)
    page = (tmp_path / "sweep.html").read_text()
    assert _ranking_header(page) == ["#", "model", "set", "top-1 after", "samples", "worst drift", "seconds"]
    assert "No top-1 before or INT8 top-1 column" in page  # these cells measured after only


def test_lower_is_better_metrics_rank_ascending():
    report = _report()
    report.rank_by = "seconds"
    for seconds, cell in zip((3.0, 1.0, None, 2.0), report.cells, strict=True):
        cell.seconds = seconds
    report.rank()
    assert report.ranking == ["m0/cam2", "m1/cam2", "m0/cam1"]


def test_unknown_metric_is_refused():
    with pytest.raises(SpecError, match="--rank-by must be one of after_top1"):
        check_metric("accuracy", "--rank-by")
