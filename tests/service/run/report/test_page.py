"""The HTML report: one self-contained page with the job, the drift chart and the ONNX
audit, that opens offline (nothing in it refers to the network)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from bnrecal.service.cli import main
from bnrecal.service.run.report.document import Report
from bnrecal.service.run.report.page import render_html_report

from tests.conftest import save_array, save_state
from tests.nets import mixed_net, perturbed


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    monkeypatch.setenv("BNRECAL_DATA_DIR", str(tmp_path / "state"))


def assert_offline(page: str) -> None:
    """No URL of any kind, no script, no stylesheet or font fetched from anywhere."""
    assert not re.search(r"(https?:|ftp:|//[a-z0-9.-]+\.[a-z]{2,})", page, re.I)
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert not re.search(r"url\(\s*['\"]?(?!#)", page)  # only the chart's own fragments: url(#clip)
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#)""", page)


def typed(fields: dict) -> Report:
    """A report of the given fields, the others as a small run would have them."""
    defaults = {
        "arch": None, "mode": "sync", "world_size": 1, "backend": "gloo", "device": "cpu", "batch_size": 4,
        "samples": 4, "steps": 1, "collectives": 1, "collectives_per_rank": [1], "seconds": 0.1,
        "samples_per_second": 40.0, "nodes": ["n1"], "memory_formats": ["contiguous"], "placement": "SPREAD",
        "data_transport": "shared", "object_store_bytes": 0, "attempts": 1, "retried_failures": [],
        "cpus_per_worker": 1.0, "dataset": {"kind": "array", "samples": 4, "sample_shape": [3, 4, 4]}, "layers": [],
        "skipped": [], "embedded_cluster": True, "order": "given", "seed": None, "standard_error_max": None,
    }
    return Report.model_validate({**defaults, **fields})


@pytest.mark.usefixtures("ray_cluster")
def test_calibrate_writes_a_self_contained_html_report(tmp_path, capsys):
    torch.manual_seed(0)
    checkpoint = save_state(tmp_path / "m.pt", perturbed(mixed_net()))
    data = save_array(tmp_path / "x.npy", torch.randn(20, 3, 6, 5))
    html, report = tmp_path / "out" / "report.html", tmp_path / "report.json"
    html.parent.mkdir()  # every output's folder must exist (checked before the run: docs/cli.md)
    code = 0
    try:
        main([
            "calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(checkpoint), "--data", str(data),
            "--workers", "2", "--batch-size", "8", "--out", str(tmp_path / "out.pt"), "--onnx", str(tmp_path / "m.onnx"),
            "--report", str(report), "--report-html", str(html),
        ])
    except SystemExit as exc:
        code = int(exc.code or 0)
    assert code == 0, capsys.readouterr().err
    page = html.read_text()
    summary = json.loads(report.read_text())
    assert page.startswith("<!doctype html>")
    # Two charts: the drift, and the standard errors as error bars per layer (the precision section).
    assert page.count("<svg") == 2 and 'id="drift-chart"' in page and 'id="precision-chart"' in page
    worst = summary["standard_error_max"]
    assert (f"Statistics \u00b1{worst['error']:.1%}, the standard error of {summary['samples']} samples: about how "
            "far more data of the same kind would move them") in page and 'id="precision-table"' in page
    for layer in summary["layers"]:
        assert layer["name"] in page and layer["class"] in page
    assert "ONNX export" in page and f"<td>{summary['onnx']['folded']}</td>" in page
    assert all(node in page for node in summary["nodes"])
    assert_offline(page)
    # Its charts were drawn after the statistics, beside the export (ChartMemo.predraw): the page
    # is byte for byte the one its report.json draws anew, the charts included.
    from bnrecal.service.run.report import charts as report_charts

    fresh = report_charts.ChartMemo()
    drawn = fresh.charts(Report.model_validate(summary), precision=True)
    assert drawn.drift in page and drawn.precision in page
    assert render_html_report(Report.model_validate(summary)) == page


def test_the_same_report_draws_the_same_page_and_predrawn_charts_are_its_charts(monkeypatch):
    """The charts' SVG ids are salted by chart, not random: the same report is the same page,
    byte for byte, whether its charts were drawn at the end or earlier in a thread of their own."""
    from bnrecal.service.run.report import charts as report_charts, page as report_html

    report = typed({"layers": [
        {"name": "bn1", "class": "BatchNorm2d", "channels": 2, "calls": 1, "mean_shift": 0.5, "var_ratio_min": 0.5,
         "var_ratio_max": 2.0},
        {"name": "bn2", "class": "BatchNorm2d", "channels": 2, "calls": 1, "mean_shift": 0.1, "var_ratio_min": 0.9,
         "var_ratio_max": 1.1},
    ]})
    monkeypatch.setattr(report_charts, "CHARTS", report_charts.ChartMemo())
    first = render_html_report(report)
    monkeypatch.setattr(report_charts, "CHARTS", report_charts.ChartMemo())
    report_charts.CHARTS.predraw(report, precision=bool(report_html.precision_sentence(report))).join()
    drawn = []
    monkeypatch.setattr(report_charts, "drift_chart_svg", lambda layers: drawn.append(layers) or "")
    assert render_html_report(report) == first and drawn == []  # taken from the memo, not drawn again
    ids = re.findall(r'id="([^"]+)"', first)
    assert len(ids) == len(set(ids))  # no id twice on the page


def test_the_page_waits_for_the_charts_drawn_ahead_and_leaves_no_thread_drawing(monkeypatch, tmp_path):
    """A page written while its charts are still being drawn ahead waits for them rather than
    drawing them again beside the thread; no drawing thread outlives the page (a process that
    exited under one aborted: exit 134 after a successful ``calibrate --report-html``)."""
    import threading
    import time

    from bnrecal.service.run.report import charts as report_charts, page as report_html

    report = typed({"layers": [{"name": "bn1", "class": "BatchNorm2d", "channels": 2, "calls": 1, "mean_shift": 0.5,
                                "var_ratio_min": 0.5, "var_ratio_max": 2.0}]})
    monkeypatch.setattr(report_charts, "CHARTS", report_charts.ChartMemo())
    drawn = []

    def slow_drift_chart(layers):
        drawn.append(threading.current_thread().name)
        time.sleep(1.0)
        return "<svg></svg>"

    monkeypatch.setattr(report_charts, "drift_chart_svg", slow_drift_chart)
    report_html.predraw_charts(report)
    report_html.write_html_report(report, tmp_path / "report.html")
    assert drawn == ["bnrecal-report-charts"]  # drawn once, ahead, and taken from there
    assert not [thread for thread in threading.enumerate() if thread.name == "bnrecal-report-charts"]


def test_a_page_written_while_another_jobs_charts_start_waits_for_them(monkeypatch, tmp_path):
    """A server writes one job's page while another job's charts start drawing: the page waits
    for that thread once it runs, never joins it before it started (which raised "cannot join
    thread before it is started" and failed the job)."""
    import threading
    import time
    import types

    from bnrecal.service.run.report import charts as report_charts, page as report_html

    class SlowToStart(threading.Thread):
        def start(self) -> None:
            time.sleep(0.5)  # the window between being made and running
            super().start()

    monkeypatch.setattr(report_charts, "CHARTS", report_charts.ChartMemo())
    monkeypatch.setattr(report_charts, "threading", types.SimpleNamespace(Thread=SlowToStart, Lock=threading.Lock))
    monkeypatch.setattr(report_charts, "drift_chart_svg", lambda layers: "<svg></svg>")
    report = typed({"layers": [{"name": "bn1", "class": "BatchNorm2d", "channels": 2, "calls": 1, "mean_shift": 0.5,
                                "var_ratio_min": 0.5, "var_ratio_max": 2.0}]})
    other = threading.Thread(target=report_html.predraw_charts, args=(report,))  # the other job's charts
    other.start()
    time.sleep(0.1)
    report_html.write_html_report(report, tmp_path / "report.html")  # raised RuntimeError before the fix
    other.join()
    assert (tmp_path / "report.html").read_text().startswith("<!doctype html>")


def test_names_are_escaped_and_missing_values_shown():
    report = {
        "arch": "tests.nets:<b>net</b>", "mode": "local", "world_size": 1, "samples": 4, "steps": 1, "seconds": 0.1,
        "layers": [{"name": "a<script>", "class": "BatchNorm1d", "channels": 2, "calls": 1,
                    "mean_shift": 0.5, "var_ratio_max": None, "var_ratio_min": None}],
        "nodes": ["n1"],
    }
    page = render_html_report(typed(report))
    assert "<script" not in page and "&lt;script&gt;" in page and "&lt;b&gt;net" in page
    assert "n/a" in page
    assert_offline(page)


def test_a_jobs_report_names_the_job_and_its_legends_sit_outside_the_axes():
    from datetime import UTC, datetime

    from bnrecal.service.run.report.charts import accuracy_figure, drift_figure
    from bnrecal.service.run.report.page import JobLabel, job_section

    digest = "sha256:" + "ab" * 32
    report = {
        "arch": "tests.nets:mixed_net", "samples": 8, "world_size": 1, "mode": "sync", "seconds": 0.5,
        "layers": [{"name": "bn", "class": "BatchNorm2d", "channels": 6, "calls": 2, "mean_shift": 1.5,
                    "var_ratio_max": 2.0, "var_ratio_min": 0.5}],
        "evaluation": {"samples": 8, "before": {"top1": 0.25, "top5": 1.0, "cross_entropy": 1.2},
                       "after": {"top1": 0.75, "top5": 1.0, "cross_entropy": 0.6}, "prediction_change": 0.5,
                       "kl_divergence": 0.1, "classes": 10, "output_shape": [10], "labelled": True, "seconds": 0.1,
                       "collectives": 1, "runtime": "pytorch",
                       "data": {"kind": "array", "source": "e.npz", "samples": 8, "sample_shape": [3, 4, 4]}},
        "job": job_section(JobLabel("0123abcd" * 4, datetime(2026, 11, 24, 21, 0, tzinfo=UTC),
                                    {"checkpoint": {"filename": "team<model>.pt", "digest": digest}})),
    }
    report = typed(report)
    page = render_html_report(report)
    context = page[page.index('id="job-context"'):page.index("</table>", page.index('id="job-context"'))]
    assert "0123abcd" * 4 in context and "2026-11-24T21:00:00+00:00" in context
    assert "team&lt;model&gt;.pt" in context and digest in context  # escaped, with its digest
    assert "bnrecal 0.1.0" in context and f"torch {torch.__version__.split('+')[0]}" in context
    assert_offline(page)
    # Each legend sits right of its axes (so it covers no bar or point) and inside the figure.
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for figure in (drift_figure(report.layers), accuracy_figure(report.evaluation)):
        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        renderer = canvas.get_renderer()
        legends = [(axes, axes.get_legend()) for axes in figure.axes if axes.get_legend() is not None]
        assert legends
        for axes, legend in legends:
            box, plot = legend.get_window_extent(renderer), axes.get_window_extent(renderer)
            assert box.x0 >= plot.x1 - 1 and box.x1 <= figure.bbox.x1 + 1, (box, plot)
