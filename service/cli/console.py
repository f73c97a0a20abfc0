"""What every ``bnrecal`` command shares: the error console, the summary lines, and
parsing of the JSON and shape flags (errors name the flag). The progress display is
``service.run.progress``, shared with the Python API."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from bnrecal.errors import BnrecalError, InputError, SpecError

from bnrecal.service.run.progress import stderr
from bnrecal.service.run.report.page import STANDARD_ERROR_MEANING as MEANING

if TYPE_CHECKING:
    from bnrecal.service.export.report_sections import Int8Section
    from bnrecal.service.run.report.document import EvaluationSection, Report

    from ..client import BnrecalClient


def parse_json_object(value: str | None, option: str) -> dict[str, Any] | None:
    """Parse a JSON object given on the command line, naming the option when it is not one."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{option} is not valid JSON: {exc.msg} at position {exc.pos}", field=option) from None
    if not isinstance(parsed, dict):
        raise SpecError(f"{option} must be a JSON object, got {type(parsed).__name__}", field=option)
    return parsed


def parse_shape(value: str) -> tuple[int, ...]:
    """Parse ``3,224,224`` into a per-sample shape, naming the option when it is not one."""
    try:
        shape = tuple(int(part) for part in value.replace("x", ",").split(","))
    except ValueError:
        raise SpecError(f"--input-shape must be comma-separated integers, got {value!r}", field="input_shape") from None
    if not shape or min(shape) < 1:
        raise SpecError(f"--input-shape must be positive integers, got {value!r}", field="input_shape")
    return shape


def summary_lines(
    report: Report, out: Path, job_id: str | None = None, also_wrote: Sequence[Path | None] = ()
) -> list[str]:
    """The closing lines of ``calibrate`` and ``submit``: what was recalibrated, every file
    written and, with evaluation data, whether it helped."""
    job = f" (job {job_id})" if job_id else ""
    lines = [
        f"recalibrated {len(report['layers'])} BN layers on {report['samples']} samples "
        f"({report['world_size']} x {report['backend']}, {report['mode']}) "
        f"in {report['seconds']:.2f} s{job} -> {out}"
    ]
    precision = statistics_line(report)
    if precision:
        lines.append(precision)
    if report.get("attempts", 1) > 1:
        failures = report.get("retried_failures") or []
        lines.append(f"retried {len(failures)} time{'s' * (len(failures) != 1)} after: {'; '.join(failures)}")
    others = [str(path) for path in also_wrote if path is not None]
    if others:
        lines.append(f"also wrote {', '.join(others)}")
    evaluation = report.get("evaluation")
    if evaluation:
        lines.append(evaluation_line(evaluation))
    if report.get("int8"):
        lines.append(int8_line(report["int8"]))
    return lines


def int8_line(section: Int8Section, path: Path | None = None) -> str:
    """One line on the INT8 export: its target and size against FP32, the ops the guard kept
    in float, and with evaluation data top-1 (a fraction; drops in points, as in the report);
    for an INT8 output that failed its guard, why there is no file."""
    where = f" {path}" if path is not None else ""
    if section.get("written") is False:
        return f"INT8{where}: not written: {section.get('failure', 'the INT8 output failed')}"
    weights = "7-bit" if section.get("reduce_range") else "8-bit"
    line = (
        f"INT8{where}: {section.get('target', 'onnxruntime')} {section['method']}, {weights} weights, "
        f"{sum(section['ops_quantized'].values())} ops quantized, "
        f"{len(section['ops_float'])} float, {section['bytes'] / 2**20:.1f} MiB "
        f"(FP32 {section['fp32_bytes'] / 2**20:.1f} MiB)"
    )
    latency = section.get("latency_ms")
    if latency:
        line += f", {latency['int8']:.2f} ms a sample in onnxruntime (FP32 {latency['fp32']:.2f} ms)"
    scores = section.get("evaluation")
    if scores:
        line += f"; top-1 FP32 {scores['fp32']['top1']:.3f}, INT8 {scores['int8']['top1']:.3f}"
        if "stale_int8" in scores:
            line += f", stale INT8 {scores['stale_int8']['top1']:.3f}"
        if "top1_drop_points" in scores:
            line += f" (drop {scores['top1_drop_points']:.2f} points)"
    guard = section.get("guard")
    if guard and guard.get("kept_float"):
        names = ", ".join(f"{op['name']} ({op['op_type']})" for op in guard["kept_float"])
        line += f"; kept in float by max_top1_drop: {names}"
    cpu = section.get("cpu")
    if cpu:
        from bnrecal.service.export.cpu import CpuFeatures

        line += f"; measured on {CpuFeatures.model_validate(cpu).describe()}"
    if section.get("saturates"):
        line += f"; SATURATES in {' and '.join(section['saturates'])}, whose INT8 kernels lack VNNI here: see int8.runtimes"
    return line


def statistics_line(report: Report) -> str | None:
    """How precise the statistics are: where ``--max-samples auto`` stopped (or that it ran out
    of data), else the worst standard error and the order the samples were drawn in."""
    worst = report.get("standard_error_max")
    where = f"worst: {worst['layer']}, {worst['statistic']} +-{worst['error']:.1%}" if worst else "no standard errors"
    convergence = report.get("convergence")
    if convergence:
        seen = f"{convergence['samples']:,} of {convergence['available_samples']:,} samples"
        if convergence["converged"]:
            return (f"statistics converged at {seen}: every standard error under +-{convergence['tolerance']:.1%}, "
                    f"{MEANING} ({where})")
        return (f"statistics did not converge to a standard error of +-{convergence['tolerance']:.1%} on all {seen} "
                f"({where}): give more data")
    if not worst:
        return None
    order = report.get("order")
    drawn = f"; order {order}" + (f", seed {report['seed']}" if order == "shuffled" else "") if order else ""
    return (f"statistics +-{worst['error']:.1%}, the standard error of {report.get('samples'):,} samples: "
            f"{MEANING} ({where}{drawn})")


def evaluation_line(evaluation: EvaluationSection) -> str:
    """One line saying what recalibration changed on the evaluation data."""
    changed = f"{evaluation['prediction_change']:.1%} of predictions changed"
    before, after = evaluation.get("before"), evaluation.get("after")
    if not before or not after:
        return (
            f"evaluation on {evaluation['samples']} samples (no labels): {changed}, "
            f"mean KL(before || after) {evaluation['kl_divergence']:.4g}"
        )
    parts = [f"top-1 {before['top1']:.3f} -> {after['top1']:.3f}"]
    if "top5" in before:
        parts.append(f"top-5 {before['top5']:.3f} -> {after['top5']:.3f}")
    parts.append(f"cross-entropy {before['cross_entropy']:.3f} -> {after['cross_entropy']:.3f}")
    return f"evaluation on {evaluation['samples']} samples: {', '.join(parts)}; {changed}"


INPUT_EXIT_CODE = 2
"""The exit code of bad input (a flag, a file, the architecture, the data): fix it and run again."""
FAILURE_EXIT_CODE = 1
"""The exit code of a run that failed for any other reason."""


def exit_code(error: BnrecalError) -> int:
    """The exit code a command ends with on ``error``: 2 for an :class:`InputError`, else 1."""
    return INPUT_EXIT_CODE if isinstance(error, InputError) else FAILURE_EXIT_CODE


def fail(message: str, code: int) -> NoReturn:
    """Print one error line and exit."""
    stderr.print(f"error: {message}", highlight=False, markup=False, soft_wrap=True)
    raise SystemExit(code)


def print_line(text: str) -> None:
    """One plain line on stderr (no markup, no highlighting)."""
    stderr.print(text, highlight=False, markup=False, soft_wrap=True)


def connect(server: str, api_key: str | None) -> BnrecalClient:
    """The HTTP client of a server command, imported only by the commands that talk HTTP
    (httpx is a fifth of what ``bnrecal --help`` would otherwise load)."""
    from ..client import BnrecalClient

    return BnrecalClient(server, api_key)
