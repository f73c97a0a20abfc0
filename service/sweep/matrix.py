"""The sweep's matrix report (docs/sweeps.md, "The matrix report"): every cell in brief, as
its single job's report has it, a ranking by the metric the user picks, and the report as
JSON (``sweep.json``), CSV ready for pandas (``sweep.csv``) and one self-contained HTML page
with a models x sets heatmap whose cells link to each cell's own report (``sweep.html``).
"""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Literal

from jinja2 import Environment, select_autoescape
from pydantic import Field

from bnrecal.errors import SpecError
from bnrecal.workers.files import atomic_write

from bnrecal.service.report_part import ReportPart
from bnrecal.service.run.report.document import DecodingReport, Report, write_report

from .cells import Cell, CellStatus

METRICS: dict[str, Literal["high", "low"]] = {
    "after_top1": "high",
    "before_top1": "high",
    "top1_gain": "high",
    "int8_top1": "high",
    "prediction_change": "low",
    "worst_drift": "low",
    "seconds": "low",
}
"""The metrics a sweep can be ranked by, and which end is best."""


def check_metric(metric: str, field_name: str = "rank_by") -> str:
    """``metric`` when the matrix can rank by it, else a ``SpecError`` naming the choices."""
    if metric not in METRICS:
        raise SpecError(f"{field_name} must be one of {', '.join(METRICS)}, got {metric!r}", field=field_name)
    return metric


class CellSummary(ReportPart):
    """One cell in brief (``cells[]``): what its single job's report says, and where it is."""

    OMIT_WHEN_NONE = frozenset({"error"})

    model: str
    model_index: int
    set_name: str = Field(alias="set")
    status: CellStatus
    samples: int | None = None
    worst_drift: float | None = None
    worst_drift_layer: str | None = None
    before_top1: float | None = None
    after_top1: float | None = None
    top1_gain: float | None = None
    prediction_change: float | None = None
    int8_top1: float | None = None
    seconds: float | None = None
    report: str | None = None
    error: str | None = None

    @classmethod
    def of(cls, cell: Cell, status: CellStatus, report: Report | None, seconds: float | None,
           error: str | None = None, link: str | None = None) -> CellSummary:
        """A cell's summary from its report (None for a cell that failed before it had one)."""
        summary = cls(model=cell.model_name, model_index=cell.model_index, set=cell.set_name, status=status,
                      seconds=None if seconds is None else round(seconds, 3), error=error, report=link)
        if report is None:
            return summary
        summary.samples = report.samples
        drifts = [layer for layer in report.layers if layer.mean_shift is not None]
        if drifts:
            worst = max(drifts, key=lambda layer: layer.mean_shift or 0.0)
            summary.worst_drift, summary.worst_drift_layer = worst.mean_shift, worst.name
        evaluation = report.evaluation
        if evaluation is not None:
            summary.prediction_change = evaluation.prediction_change
            if evaluation.before is not None and evaluation.after is not None:
                summary.before_top1, summary.after_top1 = evaluation.before.top1, evaluation.after.top1
                summary.top1_gain = evaluation.after.top1 - evaluation.before.top1
        int8 = report.int8
        if int8 is not None and int8.evaluation is not None:
            summary.int8_top1 = int8.evaluation.int8.top1
        return summary

    def value(self, metric: str) -> float | None:
        """The cell's value of a ranking metric (None when it has none)."""
        value = getattr(self, metric)
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


class SweepReport(ReportPart):
    """The matrix report (``sweep.json``): the models and sets in order, every cell in brief,
    the ranking, and what the sweep shared."""

    OMIT_WHEN_NONE = frozenset({"decoding"})

    models: list[str]
    sets: list[str]
    cells: list[CellSummary]
    rank_by: str
    ranking: list[str] = Field(default_factory=list)
    """The cells that have the metric, best first, as ``<model>/<set>``."""
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    workers: int = 1
    seconds: float = 0.0
    decoding: DecodingReport | None = None

    def rank(self) -> None:
        """Count the cells' states and rank the cells that have the metric, best first
        (ties in the cells' order)."""
        self.succeeded = sum(cell.status is CellStatus.SUCCEEDED for cell in self.cells)
        self.failed = sum(cell.status is CellStatus.FAILED for cell in self.cells)
        self.cancelled = sum(cell.status is CellStatus.CANCELLED for cell in self.cells)
        sign = -1.0 if METRICS[self.rank_by] == "high" else 1.0
        ranked = [(sign * value, i, cell) for i, cell in enumerate(self.cells)
                  if (value := cell.value(self.rank_by)) is not None]
        self.ranking = [f"{cell.model}/{cell.set_name}" for _, _, cell in sorted(ranked, key=lambda t: t[:2])]


CSV_COLUMNS = ("model", "model_index", "set", "status", "samples", "worst_drift", "worst_drift_layer", "before_top1",
               "after_top1", "top1_gain", "prediction_change", "int8_top1", "seconds", "rank", "report", "error")
"""The columns of ``sweep.csv``, one row a cell (empty where a cell has no value)."""


def sweep_csv(report: SweepReport) -> str:
    """The cells as CSV, with their rank (1 is best, empty when unranked)."""
    ranks = {key: i + 1 for i, key in enumerate(report.ranking)}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for cell in report.cells:
        row = cell.to_dict()
        row["rank"] = ranks.get(f"{cell.model}/{cell.set_name}")
        writer.writerow(["" if row.get(column) is None else row[column] for column in CSV_COLUMNS])
    return out.getvalue()


def write_sweep_report(report: SweepReport, folder: Path) -> list[Path]:
    """Write ``sweep.json``, ``sweep.csv`` and ``sweep.html`` into ``folder`` (each atomically)."""
    report.rank()
    write_report(report, folder / "sweep.json")
    written = [folder / "sweep.json"]
    for name, text in (("sweep.csv", sweep_csv(report)), ("sweep.html", sweep_html(report))):
        path = folder / name
        atomic_write(path, lambda temp, text=text: temp.write_text(text))
        written.append(path)
    return written


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>bnrecal sweep: {{ r.models|length }} models x {{ r.sets|length }} sets</title>
<style>
 body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 80em; padding: 0 1em; color: #222; }
 h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
 table { border-collapse: collapse; } td, th { padding: .25em .7em; border: 1px solid #eee; text-align: left; }
 td.num, td.cell { text-align: right; font-variant-numeric: tabular-nums; } .muted { color: #777; }
 td.cell a { color: inherit; text-decoration: none; display: block; } td.failed { background: #eee; color: #a00; }
</style>
</head>
<body>
<h1>BatchNorm recalibration sweep</h1>
<p class="muted">{{ r.models|length }} models x {{ r.sets|length }} sets: {{ r.succeeded }} cells succeeded,
{{ r.failed }} failed{% if r.cancelled %}, {{ r.cancelled }} cancelled{% endif %}; {{ r.workers }} worker(s),
{{ "%.1f"|format(r.seconds) }} s.{% if r.decoding and r.decoding.decoded %} Samples decoded {{ r.decoding.decoded }}, read again from
what was kept {{ r.decoding.reused }}.{% elif r.decoding %} No set needed decoding (arrays are read as they are).{% endif %}</p>

<h2 id="heatmap">{{ metric_label }}: models x sets</h2>
<p class="muted">Colour: {{ "higher" if best == "high" else "lower" }} is better (green). Each cell links to its own report.</p>
<table id="heatmap-table">
<tr><th>model</th>{% for s in r.sets %}<th>{{ s }}</th>{% endfor %}</tr>
{% for m in r.models %}<tr><th>{{ m }}</th>{% for s in r.sets %}{% set c = grid.get((m, s)) %}
{% if c is none %}<td class="muted">&middot;</td>
{% elif c.status.value != "succeeded" %}<td class="cell failed" title="{{ c.error or c.status.value }}">{% if c.report %}<a href="{{ c.report }}">{{ c.status.value }}</a>{% else %}{{ c.status.value }}{% endif %}</td>
{% else %}<td class="cell" style="background: {{ colour(c) }}" title="{{ m }} / {{ s }}"><a href="{{ c.report }}">{{ fmt(c.value(r.rank_by)) }}</a></td>{% endif %}
{% endfor %}</tr>
{% endfor %}</table>

<h2 id="ranking">Ranking by {{ metric_label }}</h2>
<table id="ranking-table">
<tr><th>#</th><th>model</th><th>set</th><th>{{ metric_label }}</th><th>samples</th>{% for key, label in columns %}<th>{{ label }}</th>{% endfor %}</tr>
{% for key in r.ranking %}{% set c = by_key[key] %}<tr><td class="num">{{ loop.index }}</td><td>{{ c.model }}</td><td>{{ c.set_name }}</td>
<td class="num">{{ fmt(c.value(r.rank_by)) }}</td><td class="num">{{ c.samples }}</td>{% for key, label in columns %}<td class="num">{{ fmt(c.value(key)) }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% if left_out %}<p class="muted" id="no-evaluation">No {{ left_out|join(" or ") }} column: no cell measured it (top-1 needs evaluation data, <code>--eval-data</code>; INT8 top-1 an INT8 file too, <code>--onnx-int8</code>).</p>{% endif %}
{% if failed %}
<h2 id="failed">Failed cells</h2>
<table id="failed-table">
{% for c in failed %}<tr><td>{{ c.model }}</td><td>{{ c.set_name }}</td><td>{{ c.status.value }}</td><td>{{ c.error or "" }}</td></tr>
{% endfor %}</table>
{% endif %}
</body>
</html>
"""

_LABELS = {
    "after_top1": "top-1 after", "before_top1": "top-1 before", "top1_gain": "top-1 gain", "int8_top1": "INT8 top-1",
    "prediction_change": "predictions changed", "worst_drift": "worst drift (std)", "seconds": "seconds",
}


def sweep_html(report: SweepReport) -> str:
    """The matrix report as one self-contained HTML page (no script, nothing fetched)."""
    values = [v for cell in report.cells if cell.status is CellStatus.SUCCEEDED
              if (v := cell.value(report.rank_by)) is not None]
    low, high = (min(values), max(values)) if values else (0.0, 0.0)
    best = METRICS[report.rank_by]

    def colour(cell: CellSummary) -> str:
        value = cell.value(report.rank_by)
        if value is None:
            return "#fff"
        share = 0.5 if high == low else (value - low) / (high - low)
        goodness = share if best == "high" else 1.0 - share  # 0 worst .. 1 best: red to green
        return f"hsl({round(120 * goodness)}, 70%, 80%)"

    columns, left_out = _ranking_columns(report)
    environment = Environment(autoescape=select_autoescape(default=True, default_for_string=True))
    return environment.from_string(_PAGE).render(
        r=report, grid={(c.model, c.set_name): c for c in report.cells}, columns=columns, left_out=left_out,
        by_key={f"{c.model}/{c.set_name}": c for c in report.cells},
        failed=[c for c in report.cells if c.status is not CellStatus.SUCCEEDED],
        metric_label=_LABELS[report.rank_by], best=best, colour=colour, fmt=_fmt,
    )


def _ranking_columns(report: SweepReport) -> tuple[list[tuple[str, str]], list[str]]:
    """The ranking table's columns after the ranking metric's own (not shown twice), and the
    top-1 columns left out because no cell has a value for them."""
    columns, left_out = [], []
    for key in ("worst_drift", "before_top1", "after_top1", "int8_top1", "seconds"):
        label = _LABELS[key].replace(" (std)", "")
        if key == report.rank_by:
            continue
        if key.endswith("top1") and all(cell.value(key) is None for cell in report.cells):
            left_out.append(label)
            continue
        columns.append((key, label))
    return columns, left_out


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def relative_link(path: Path, folder: Path) -> str:
    """``path`` as a link from a page in ``folder`` (forward slashes)."""
    return Path(os.path.relpath(path, folder)).as_posix()
