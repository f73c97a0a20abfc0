"""The report page's charts (docs/report.md, "The HTML report"): how far each BN layer's
statistics moved against its depth, each layer's standard errors, and the accuracy before and
after, drawn by matplotlib as inline SVG; the same inputs are the same bytes, and a run draws
them once, as soon as the statistics are in (``ChartMemo``).
"""

from __future__ import annotations

import io
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bnrecal.service.run.report.document import EvaluationSection, LayerReport, Report


@dataclass(frozen=True)
class Charts:
    """A report page's charts as inline SVG ("" where the report has none)."""

    drift: str
    precision: str
    accuracy: str


class ChartMemo:
    """The charts of a page, drawn once for their inputs (docs/report.md, "The HTML report").

    Drawing them (matplotlib: its import, fonts, three figures) is most of what writing
    ``report.html`` costs, 2-4 s on this project's machines, and each chart depends only on
    parts of the report that are known when the statistics are: ``predraw`` draws them then,
    in a thread of its own, while the run's later phases (exports, INT8) keep its ranks busy,
    and the page written at the end takes them from here. A chart whose inputs changed since
    (an evaluation measured later) is drawn again; the SVG of the same inputs is the same
    bytes (``_inline_svg``), so the page is the one drawn at the end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drawn: dict[tuple[str, str], str] = {}
        self._drawing: list[threading.Thread] = []

    def predraw(self, report: Report, *, precision: bool) -> threading.Thread:
        """Draw ``report``'s charts in a daemon thread; the thread is returned, started."""
        thread = threading.Thread(target=self.charts, args=(report.model_copy(deep=True),),
                                  kwargs={"precision": precision}, daemon=True, name="bnrecal-report-charts")
        with self._lock:  # started before it is listed: settle, in another job's thread, joins only started ones
            thread.start()
            self._drawing = [drawing for drawing in self._drawing if drawing.is_alive()] + [thread]
        return thread

    def settle(self) -> None:
        """Wait for the charts being drawn ahead. The page takes them from here rather than
        drawing them a second time beside the thread, and a process must not exit while
        matplotlib draws in a thread of it: the interpreter's exit under a drawing thread
        aborts the process (``terminate called without an active exception``, exit 134)."""
        with self._lock:
            drawing = list(self._drawing)
        for thread in drawing:
            thread.join()

    def charts(self, report: Report, *, precision: bool) -> Charts:
        """``report``'s charts (its standard errors' with ``precision``), drawn now unless drawn
        already for the same inputs."""
        evaluation = report.evaluation
        layers = [layer.to_dict() for layer in report.layers]
        convergence = report.convergence.to_dict() if report.convergence is not None else None
        return Charts(
            drift=self._chart("drift", layers, lambda: drift_chart_svg(report.layers)),
            precision=self._chart("precision", [layers, convergence], lambda: precision_chart_svg(report))
            if precision else "",
            accuracy=self._chart("accuracy", [evaluation.before, evaluation.after],
                                 lambda: accuracy_chart_svg(evaluation))
            if evaluation is not None and evaluation.before else "",
        )

    def _chart(self, name: str, inputs: Any, draw: Any) -> str:
        import json

        key = (name, json.dumps(inputs, sort_keys=True, default=str))
        with self._lock:
            if key in self._drawn:
                return self._drawn[key]
        svg = draw()
        with self._lock:
            if len(self._drawn) > 64:  # a server's jobs: keep the newest few
                self._drawn.clear()
            self._drawn[key] = svg
        return svg


CHARTS = ChartMemo()
"""This process's charts, drawn once for their inputs."""


def drift_chart_svg(layers: Sequence[LayerReport]) -> str:
    """Mean shift and variance ratio of each layer against its depth, as inline SVG."""
    return _inline_svg(drift_figure(layers), "drift")


def drift_figure(layers: Sequence[LayerReport]) -> Any:
    """The drift chart as a matplotlib figure (its legend right of the axes, over no point)."""
    from matplotlib.figure import Figure

    depth = list(range(len(layers)))
    shifts = [_number(layer.mean_shift) for layer in layers]
    ratios = [_ratio(layer.var_ratio_max) for layer in layers]
    lows = [_ratio(layer.var_ratio_min) for layer in layers]
    width = min(40.0, max(8.0, 0.28 * len(layers)))
    figure = Figure(figsize=(width, 5.0), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True)
    top.bar(depth, shifts, color="#3b6ea8")
    top.set_ylabel("mean shift (old std)")
    bottom.vlines(depth, [low if math.isfinite(low) else high for low, high in zip(lows, ratios)], ratios,
                  color="#c0633a", linewidth=3)
    bottom.scatter(depth, ratios, color="#c0633a", marker="^", s=28, zorder=3, label="max over channels")
    bottom.scatter(depth, lows, color="#5a2a12", marker="v", s=28, zorder=3, label="min over channels")
    bottom.axhline(1.0, color="#555", linewidth=0.8)
    bottom.set_yscale("log")
    bottom.set_ylabel("variance ratio (new / old)")
    bottom.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)  # outside: never over a point
    bottom.set_xticks(depth, [layer.name for layer in layers], rotation=90, fontsize=7)
    bottom.set_xlabel("BN layer, in module order")
    for axes in (top, bottom):
        axes.grid(axis="y", alpha=0.3)
    return figure


def precision_chart_svg(report: Report) -> str:
    """Each layer's standard errors (median to worst channel) against its depth, as inline SVG."""
    return _inline_svg(precision_figure(report), "precision")


def precision_figure(report: Report) -> Any:
    """The error bars per layer: mean (std units) and variance (relative), in percent, with
    the tolerance of ``max_samples: "auto"`` as a line."""
    from matplotlib.figure import Figure

    layers = report.layers
    depth = list(range(len(layers)))
    width = min(40.0, max(8.0, 0.28 * len(layers)))
    figure = Figure(figsize=(width, 3.2), layout="constrained")
    axes = figure.subplots()
    for offset, key, color, label in ((-0.15, "se_mean", "#3b6ea8", "mean (std units)"),
                                      (0.15, "se_var", "#c0633a", "variance (relative)")):
        median = [100 * _number(getattr(layer, f"{key}_median")) for layer in layers]
        worst = [100 * _number(getattr(layer, f"{key}_max")) for layer in layers]
        x = [d + offset for d in depth]
        axes.vlines(x, median, worst, color=color, linewidth=3)
        axes.scatter(x, worst, color=color, marker="_", s=60, zorder=3, label=f"{label}: worst")
        axes.scatter(x, median, color=color, marker="o", s=14, zorder=3, label=f"{label}: median")
    tolerance = report.convergence.tolerance if report.convergence is not None else None
    if tolerance:
        axes.axhline(100 * tolerance, color="#555", linestyle="--", linewidth=0.8, label="tolerance")
    axes.set_ylabel("standard error (%)")
    axes.set_ylim(bottom=0)
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    axes.set_xticks(depth, [layer.name for layer in layers], rotation=90, fontsize=7)
    axes.grid(axis="y", alpha=0.3)
    return figure


def accuracy_chart_svg(evaluation: EvaluationSection) -> str:
    """Accuracy before and after recalibration, side by side per metric, as inline SVG."""
    return _inline_svg(accuracy_figure(evaluation), "accuracy")


def accuracy_figure(evaluation: EvaluationSection) -> Any:
    """The accuracy chart as a matplotlib figure (its legend right of the axes, over no bar)."""
    from matplotlib.figure import Figure

    assert evaluation.before is not None and evaluation.after is not None
    scores = {"before": evaluation.before, "after": evaluation.after}
    names = [name for name in ("top1", "top5") if name in evaluation.before]
    figure = Figure(figsize=(5.0, 2.8), layout="constrained")
    axes = figure.subplots()
    positions = range(len(names))
    for offset, (when, color) in ((-0.2, ("before", "#9aa5b1")), (0.2, ("after", "#2e8b57"))):
        values = [scores[when][name] for name in names]
        bars = axes.bar([p + offset for p in positions], values, width=0.38, color=color, label=when)
        axes.bar_label(bars, fmt="%.3f", fontsize=8)
    axes.set_xticks(list(positions), [name.replace("top", "top-") for name in names])
    axes.set_ylim(0, 1.1)
    axes.set_ylabel("accuracy")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)  # outside: never over a bar
    axes.grid(axis="y", alpha=0.3)
    return figure


def _inline_svg(figure: Any, name: str) -> str:
    """A matplotlib figure as an SVG made fit to sit inside HTML: no XML prologue, doctype,
    metadata or namespace declarations (an inline <svg> needs none, and they spell out URLs).
    Its ids are salted with the chart's ``name``: the same figure gives the same bytes, and two
    charts of one page share no id."""
    import matplotlib

    buffer = io.StringIO()
    with _SVG_LOCK, matplotlib.rc_context({"svg.hashsalt": f"bnrecal-{name}"}):
        figure.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buffer.getvalue()
    svg = re.sub(r"<\?xml[^>]*\?>", "", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>", "", svg, flags=re.S)
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)
    return svg.replace("xlink:href", "href").strip()


_SVG_LOCK = threading.Lock()
"""matplotlib's settings are the process's: one SVG is written at a time under the salt."""


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _ratio(value: Any) -> float:
    """A ratio for the log axis: a missing or non-positive one is not drawn (NaN), not 0."""
    return float(value) if isinstance(value, (int, float)) and value > 0 else math.nan
