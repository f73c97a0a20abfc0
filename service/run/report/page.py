"""The run report as one self-contained HTML file: opens offline in any browser.

What the job was (model, data, options, where each rank ran and how fast), how far each
BN layer's statistics moved (a chart of mean shift and variance ratio against layer
depth, with the layers' names, and the table behind it), how precisely each layer's new
statistics are known (its standard errors as error bars, and where ``max_samples: "auto"``
stopped), the layers left alone, and the ONNX fold audit. The charts are drawn by matplotlib as inline SVG
(``report_charts``); nothing in the file refers to the network (no script, font or stylesheet is fetched).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import Environment, select_autoescape

from bnrecal.workers.files import atomic_write

from bnrecal.service.run.report import charts as report_charts

if TYPE_CHECKING:  # the page's module stays light: the console imports its wording, without torch
    from bnrecal.service.run.report.document import JobSection, Report

_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>bnrecal report: {{ model }}</title>
<style>
 body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; padding: 0 1em; color: #222; }
 h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
 table { border-collapse: collapse; } td, th { padding: .2em .8em; border-bottom: 1px solid #eee; text-align: left; }
 td.num { text-align: right; font-variant-numeric: tabular-nums; } .muted { color: #777; }
 figure { margin: 1em 0; } svg { max-width: 100%; height: auto; }
 table { display: block; max-width: 100%; overflow-x: auto; } code { overflow-wrap: anywhere; }
</style>
</head>
<body>
<h1>BatchNorm recalibration: {{ model }}</h1>
<p class="muted">{{ r.layers|length }} BN layers recalibrated on {{ r.samples }} samples,
{{ r.world_size }} worker(s), {{ r.mode }} mode, {{ "%.2f"|format(r.seconds) }} s.</p>
<table id="job-context">
{% if context.id %}<tr><th>job</th><td><code>{{ context.id }}</code></td></tr>{% endif %}
{% if context.submitted_at %}<tr><th>submitted</th><td>{{ context.submitted_at }}</td></tr>{% endif %}
{% if context.written_at %}<tr><th>report written</th><td>{{ context.written_at }}</td></tr>{% endif %}
{% for field, entry in (context.inputs or {}).items() %}<tr><th>{{ field }}</th>
<td>{{ entry.filename or "(no file name)" }} <code class="muted">{{ entry.digest }}</code></td></tr>
{% endfor %}<tr><th>versions</th><td>{% for name, version in versions.items() %}{{ name }} {{ version }}{% if not loop.last %}, {% endif %}{% endfor %}</td></tr>
</table>

{% if ev %}
<h2 id="evaluation">Evaluation: before and after</h2>
<p class="muted">{{ ev.samples }} samples of {{ ev.data.source if ev.data else "evaluation data" }};
"before" is the model with its uploaded BN statistics, "after" with the recalibrated ones.</p>
{% if ev.before %}
<table id="evaluation-table">
<tr><th>metric</th><th>before</th><th>after</th><th>change</th></tr>
{% for name, label in metrics %}{% if name in ev.before %}<tr><th>{{ label }}</th>
<td class="num">{{ "%.4f"|format(ev.before[name]) }}</td><td class="num">{{ "%.4f"|format(ev.after[name]) }}</td>
<td class="num">{{ "%+.4f"|format(ev.after[name] - ev.before[name]) }}</td></tr>
{% endif %}{% endfor %}</table>
<figure id="accuracy-chart">{{ accuracy_chart|safe }}</figure>
{% endif %}
<table>
<tr><th>predictions changed</th><td class="num">{{ "%.2f"|format(100 * ev.prediction_change) }} %</td></tr>
<tr><th>mean KL(before &#8741; after)</th><td class="num">{{ fmt(ev.kl_divergence) }}</td></tr>
</table>
{% if ev.note %}<p class="muted">{{ ev.note }}</p>{% endif %}
{% endif %}

<h2>Job</h2>
<table>
{% for key, value in job %}<tr><th>{{ key }}</th><td>{{ value }}</td></tr>
{% endfor %}</table>

<h2>Ranks</h2>
<table>
<tr><th>rank</th><th>node</th><th>layout</th><th>collectives</th></tr>
{% for rank in ranks %}<tr><td class="num">{{ rank.rank }}</td><td>{% if rank.host %}{{ rank.host }} <code class="muted" title="{{ rank.node }}">{{ rank.node[:8] }}</code>{% else %}{{ rank.node }}{% endif %}</td><td>{{ rank.layout }}</td>
<td class="num">{{ rank.collectives }}</td></tr>
{% endfor %}</table>

<h2 id="drift">Drift per layer</h2>
<p class="muted">mean shift: largest change of a channel's mean, in units of its old standard deviation;
variance ratio: largest and smallest new / old variance of a channel (1 = unchanged). Values far
from 0 and 1 are statistics that were stale.</p>
<figure id="drift-chart">{{ chart|safe }}</figure>
<table id="drift-table">
<tr><th>#</th><th>layer</th><th>class</th><th>channels</th><th>calls</th><th>mean shift</th><th>variance ratio (min)</th><th>variance ratio (max)</th></tr>
{% for layer in r.layers %}<tr><td class="num">{{ loop.index0 }}</td><td>{{ layer.name }}</td><td>{{ layer["class"] }}</td>
<td class="num">{{ layer.channels }}</td><td class="num">{{ layer.calls }}</td>
<td class="num">{{ fmt(layer.mean_shift) }}</td><td class="num">{{ fmt(layer.var_ratio_min) }}</td>
<td class="num">{{ fmt(layer.var_ratio_max) }}</td></tr>
{% endfor %}</table>
{% if precision %}
<h2 id="precision">Precision per layer</h2>
<p class="muted" id="precision-summary">{{ precision }}</p>
<p class="muted">Standard error of each layer's new statistics, from the spread between the global batches
(samples in {{ r.order or "given" }} order{% if r.order == "shuffled" %}, seed {{ r.seed }}{% endif %}):
the mean in units of the channel's standard deviation, the variance relative. The bar runs from the
median channel to the worst; about 95% of true errors lie within two of them.</p>
<figure id="precision-chart">{{ precision_chart|safe }}</figure>
<table id="precision-table">
<tr><th>#</th><th>layer</th><th>mean &#177; (median)</th><th>mean &#177; (worst)</th><th>variance &#177; (median)</th><th>variance &#177; (worst)</th></tr>
{% for layer in r.layers %}<tr><td class="num">{{ loop.index0 }}</td><td>{{ layer.name }}</td>
<td class="num">{{ pct(layer.se_mean_median) }}</td><td class="num">{{ pct(layer.se_mean_max) }}</td>
<td class="num">{{ pct(layer.se_var_median) }}</td><td class="num">{{ pct(layer.se_var_max) }}</td></tr>
{% endfor %}</table>
{% endif %}
{% if r.skipped %}
<h2>Layers left alone</h2>
<table>
{% for layer in r.skipped %}<tr><td>{{ layer.name }}</td><td>{{ layer.reason }}</td></tr>
{% endfor %}</table>
{% endif %}
{% if r.onnx %}
<h2 id="onnx">ONNX export</h2>
<table>
<tr><th>opset</th><td>{{ r.onnx.opset }}</td></tr>
<tr><th>BN folded</th><td>{{ r.onnx.folded }}</td></tr>
<tr><th>BN left in the graph</th><td>{{ r.onnx.batchnorm_nodes }}</td></tr>
<tr><th>max abs / rel diff vs PyTorch</th><td>{{ fmt(r.onnx.max_abs_diff) }} / {{ fmt(r.onnx.max_rel_diff) }}</td></tr>
{% if r.onnx.runtimes %}<tr><th>runtimes that ran the file</th><td>{% for name in ("onnxruntime", "openvino") %}{% set rt = r.onnx.runtimes[name] %}{% if rt %}{{ name }} {% if rt.ran %}{{ rt.version }}: max abs diff {{ fmt(rt.max_abs_diff) }}{% else %}not run ({{ rt.reason }}){% endif %}{% if not loop.last %}; {% endif %}{% endif %}{% endfor %}</td></tr>{% endif %}
</table>
{% if r.onnx.unfolded %}
<table>
<tr><th>left in the graph</th><th>reason</th></tr>
{% for item in r.onnx.unfolded %}<tr><td>{{ item.name }}</td><td>{{ item.reason }}</td></tr>
{% endfor %}</table>
{% endif %}
{% endif %}
{% if r.int8 %}{% set q = r.int8 %}
<h2 id="int8">INT8 export</h2>
{% if q.written == false %}<p class="int8-failed">No INT8 file: {{ q.failure }}</p>{% endif %}
<table>
{% if q.target %}<tr><th>target runtime</th><td>{{ q.target }}</td></tr>{% endif %}
<tr><th>method</th><td>{{ q.method }}{% if q.ranges_as_minmax and q.ranges_as_minmax.note %} ({{ q.ranges_as_minmax.note }}){% endif %}</td></tr>
<tr><th>weights / activations</th><td>{{ q.weight_type }} {{ q.weights }} / {{ q.activation_type }}{% if q.weights_why %} ({{ q.weights_why }}){% endif %}</td></tr>
<tr><th>ranges</th><td>{{ q.samples }} samples on {{ q.world_size }} ranks, collectives {{ q.collectives|join(", ") }}</td></tr>
<tr><th>ops quantized</th><td>{% for op, n in (q.ops_quantized or {}).items() %}{{ op }} {{ n }}{% if not loop.last %}, {% endif %}{% endfor %}</td></tr>
{% if q.bytes %}<tr><th>size</th><td>{{ (q.bytes / 1048576)|round(2) }} MiB (FP32 {{ (q.fp32_bytes / 1048576)|round(2) }} MiB)</td></tr>
<tr><th>max abs diff vs FP32</th><td>{{ fmt(q.max_abs_diff) }} (FP32 outputs up to {{ fmt(q.fp32_max_abs) }})</td></tr>{% endif %}
{% if q.runtimes %}<tr><th>runtimes that ran the file</th><td>{% for name in ("onnxruntime", "openvino") %}{% set rt = q.runtimes[name] %}{% if rt %}{{ name }} {% if rt.ran %}{{ rt.version }}: max abs diff vs FP32 {{ fmt(rt.max_abs_diff) }}{% if rt.max_abs_diff_to_qdq is not none %}, vs its own Q/DQ arithmetic {{ fmt(rt.max_abs_diff_to_qdq) }}{% endif %}{% if rt.saturates %} <strong class="int8-saturates">SATURATES</strong>: {{ rt.reason }}{% endif %}{% else %}not run ({{ rt.reason }}){% endif %}{% if not loop.last %}; {% endif %}{% endif %}{% endfor %}</td></tr>{% endif %}
{% if q.cpu %}<tr><th>checked on</th><td>{{ q.cpu.describe() }}</td></tr>{% endif %}
{% if q.guard %}<tr><th>accuracy guard</th><td>max_top1_drop {{ q.guard.max_top1_drop }} points; float ops chosen on {{ q.guard.selection.samples }} {{ q.guard.selection.which }}, accuracies below on {{ q.guard.report.samples }} {{ q.guard.report.which }}{% if q.guard.kept_float %}; kept in float: {% for op in q.guard.kept_float %}{{ op.name }} ({{ op.op_type }}, {{ fmt(op.top1_gain_alone_points) }} points alone){% if not loop.last %}, {% endif %}{% endfor %}{% endif %}</td></tr>{% endif %}
{% if q.latency_ms %}<tr><th>onnxruntime latency, batch 1</th><td>{{ fmt(q.latency_ms.int8) }} ms (FP32 {{ fmt(q.latency_ms.fp32) }} ms)</td></tr>{% endif %}
</table>
{% if q.evaluation %}{% set e = q.evaluation %}
<table class="int8-accuracy">
<tr><th>on {{ e.samples }} evaluation samples</th><th>top-1</th><th>top-5</th></tr>
{% for key, label in (("stale_fp32", "FP32, stale statistics"), ("fp32", "FP32, recalibrated"), ("stale_int8", "INT8, stale statistics"), ("int8", "INT8, recalibrated")) %}{% if e[key] %}<tr><td>{{ label }}</td><td class="num">{{ fmt(e[key].top1) }}</td><td class="num">{{ fmt(e[key].top5) }}</td></tr>
{% endif %}{% endfor %}</table>
{% endif %}
{% if q.ops_float %}
<table class="int8-float">
<tr><th>left in float</th><th>op</th><th>reason</th></tr>
{% for item in q.ops_float %}<tr><td>{{ item.name }}</td><td>{{ item.op_type }}</td><td>{{ item.reason }}</td></tr>
{% endfor %}</table>
{% endif %}
{% endif %}
</body>
</html>
"""

_METRICS = (("top1", "top-1 accuracy"), ("top5", "top-5 accuracy"), ("cross_entropy", "cross-entropy"))

_ENVIRONMENT = Environment(autoescape=select_autoescape(default=True, default_for_string=True))


def render_html_report(report: Report) -> str:
    """The report as one self-contained HTML page."""
    hosts = report.job.hosts if report.job is not None else {}
    formats, collectives = report.memory_formats, report.collectives_per_rank
    ranks = [
        {
            "rank": rank,
            "node": node,
            "host": hosts.get(node),
            "layout": formats[rank] if rank < len(formats) else "",
            "collectives": collectives[rank] if rank < len(collectives) else "",
        }
        for rank, node in enumerate(report.nodes)
    ]
    dataset, program = report.dataset, report.program
    model = report.arch or (f"program {program.name}" if program else "")
    job = [
        ("architecture", report.arch) if not program else ("program", f"{program.name} ({program.batch})"),
        ("mode", report.mode),
        ("workers", f"{report.world_size} ({report.backend}, {report.device})"),
        ("batch size", report.batch_size),
        ("samples / steps", f"{report.samples} / {report.steps}"),
        ("data", f"{dataset.kind}, {dataset.samples} samples of {dataset.sample_shape}"),
        ("calibration pass", f"{report.seconds:.2f} s, {report.samples_per_second or 0:.1f} samples/s"),
        ("placement / transport", f"{report.placement} / {report.data_transport}"),
        ("attempts", report.attempts),
    ]
    evaluation = report.evaluation
    charts = report_charts.CHARTS.charts(report, precision=bool(precision_sentence(report)))
    template = _ENVIRONMENT.from_string(_TEMPLATE)
    precision = precision_sentence(report)
    return template.render(
        r=report, model=model, job=job, ranks=ranks, chart=charts.drift, fmt=_format, pct=_percent,
        precision=precision, precision_chart=charts.precision if precision else "",
        ev=evaluation, metrics=_METRICS, accuracy_chart=charts.accuracy,
        context=report.job or {}, versions=report.job.versions.to_dict() if report.job else software_versions(),
    )


def software_versions() -> dict[str, str]:
    """The versions of bnrecal and torch (and Python) that wrote a report."""
    versions = {}
    for name in ("bnrecal", "torch"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "unknown"
    versions["python"] = platform.python_version()
    return versions


@dataclass(frozen=True)
class JobLabel:
    """What names a server job in its report: its id, when it was submitted, and its inputs
    (file name and digest by spec field)."""

    id: str
    submitted_at: datetime
    inputs: dict[str, dict[str, str | None]]


def job_section(label: JobLabel, nodes: list[str] | None = None) -> JobSection:
    """What names the job in its report: its id, when it was submitted and the report
    written, its inputs (file name and digest by spec field), the software versions, and
    the host name of each Ray node its ranks ran on (``nodes``: their ids)."""
    from bnrecal.service.run.report.document import InputFile, JobSection, Versions

    return JobSection(
        id=label.id,
        submitted_at=label.submitted_at.astimezone(UTC).isoformat(timespec="seconds"),
        written_at=datetime.now(UTC).isoformat(timespec="seconds"),
        inputs={field: InputFile.model_validate(entry) for field, entry in label.inputs.items()},
        versions=Versions.model_validate(software_versions()),
        hosts=node_hosts(nodes or []),
    )


def node_hosts(nodes: list[str]) -> dict[str, str]:
    """The host name of each of these Ray node ids, as the connected cluster knows it (a
    node id alone is 56 characters that say nothing to a reader); empty without Ray."""
    import ray

    if not nodes or not ray.is_initialized():
        return {}
    wanted = set(nodes)
    return {
        node["NodeID"]: str(node.get("NodeManagerHostname") or node.get("NodeManagerAddress"))
        for node in ray.nodes()
        if node.get("NodeID") in wanted and (node.get("NodeManagerHostname") or node.get("NodeManagerAddress"))
    }


def predraw_charts(report: Report) -> None:
    """Start drawing ``report``'s charts in a thread of their own (``report_charts.ChartMemo``):
    the page written later takes them, the same bytes."""
    report_charts.CHARTS.predraw(report, precision=bool(precision_sentence(report)))


def write_html_report(report: Report, path: str | os.PathLike[str]) -> None:
    """Write the HTML report, atomically."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    report_charts.CHARTS.settle()  # the charts drawn ahead (predraw_charts) are finished, not drawn twice
    text = render_html_report(report)
    atomic_write(target, lambda temp: temp.write_text(text, encoding="utf-8"))


STANDARD_ERROR_MEANING = "about how far more data of the same kind would move them"
"""What a standard error of the statistics means, said wherever one is shown: here, on the
console (service/cli/console.py) and on the web page's job view (api/static/format.js)."""


def precision_sentence(report: Report) -> str:
    """Where ``max_samples: "auto"`` stopped, or the worst standard error; empty without any."""
    worst = report.standard_error_max
    if worst is None:
        return ""
    where = f"worst: {worst.layer}, {worst.statistic} \u00b1{worst.error:.1%}"
    convergence = report.convergence
    if convergence is not None:
        seen = f"{convergence.samples:,} of {convergence.available_samples:,} samples"
        if convergence.converged:
            return (f"Statistics converged at {seen}: every standard error under \u00b1{convergence.tolerance:.1%}, "
                    f"{STANDARD_ERROR_MEANING} ({where}).")
        return (f"Did not converge to a standard error of \u00b1{convergence.tolerance:.1%} on all {seen} "
                f"({where}): give more data.")
    return (f"Statistics \u00b1{worst.error:.1%}, the standard error of {report.samples} samples: "
            f"{STANDARD_ERROR_MEANING} ({where}).")


def _percent(value: Any) -> str:
    return f"{100 * value:.2f} %" if isinstance(value, (int, float)) else "n/a"


def _format(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
