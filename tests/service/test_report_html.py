"""The HTML report: one self-contained page with the job, the drift chart and the ONNX
audit, that opens offline (nothing in it refers to the network)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from service.cli import main
from service.report_html import render_html_report
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


@pytest.mark.usefixtures("ray_cluster")
def test_calibrate_writes_a_self_contained_html_report(tmp_path, capsys):
    torch.manual_seed(0)
    checkpoint = save_state(tmp_path / "m.pt", perturbed(mixed_net()))
    data = save_array(tmp_path / "x.npy", torch.randn(20, 3, 6, 5))
    html, report = tmp_path / "out" / "report.html", tmp_path / "report.json"
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
    assert page.count("<svg") == 1 and 'id="drift-chart"' in page
    for layer in summary["layers"]:
        assert layer["name"] in page and layer["class"] in page
    assert "ONNX export" in page and f"<td>{summary['onnx']['folded']}</td>" in page
    assert all(node in page for node in summary["nodes"])
    assert_offline(page)


def test_names_are_escaped_and_missing_values_shown():
    report = {
        "arch": "tests.nets:<b>net</b>", "mode": "local", "world_size": 1, "samples": 4, "steps": 1, "seconds": 0.1,
        "layers": [{"name": "a<script>", "class": "BatchNorm1d", "channels": 2, "calls": 1,
                    "mean_shift": 0.5, "var_ratio_max": None}],
        "nodes": ["n1"],
    }
    page = render_html_report(report)
    assert "<script" not in page and "&lt;script&gt;" in page and "&lt;b&gt;net" in page
    assert "n/a" in page
    assert_offline(page)
