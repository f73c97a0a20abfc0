"""The INT8 file checked like the FP32 export (docs/onnx.md, "The file"; docs/int8.md,
"Checks and the report's `int8` section"): ``onnx.checker`` full check, runs in
onnxruntime, its outputs against the FP32 export's on calibration samples; its latency;
and the labelled evaluation data the Python API holds in memory (scored by the passes of
``workers.ranks.ort.rank_pass``, as the ranks score theirs).

Sessions here run with onnxruntime's default graph optimizations, as a deployment runs
the file: that is where QuantizeLinear/DequantizeLinear pairs become INT8 kernels; the
file's own arithmetic (``qdq_arithmetic``) runs with them off, as written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from bnrecal.errors import ExportError, first_line
from bnrecal.workers.engine.ranges import fixed_batch
from bnrecal.workers.ranks.ort.rank_pass import scoring_session

from bnrecal.service.export.cpu import CpuFeatures, cpu_features
from bnrecal.service.export.report_sections import Int8Checks, RuntimeChecks, RuntimeEntry
from bnrecal.service.export.runtimes import (
    RuntimeRun, largest_difference, onnxruntime_version, runtime_entry, start_openvino, warm_openvino,
)


def session(model: bytes, threads: int | None = None):
    """An onnxruntime CPU session with the default (full) graph optimizations."""
    return scoring_session(model, threads or min(4, os.cpu_count() or 1))


DEPARTURE_SHARE = 0.05
"""A runtime's INT8 outputs may depart from the file's own arithmetic (its Q/DQ ops run as
written, in float: ``qdq_arithmetic``) by this share of the FP32 outputs' scale, or by twice
the file's own rounding (its arithmetic against the FP32 export), whichever is larger: the
runtimes' fused kernels round requantized values their own way. Measured (docs/int8.md,
"Every x86 CPU"): on the digits resnet18 (outputs up to 27-32) onnxruntime departs by 0-0.7%
of the scale and OpenVINO by 1.3-2%, the same 8-bit file saturating in OpenVINO without VNNI
by 13-23%; on small random-weight models (outputs up to 0.03-0.5), whose scale is mostly
rounding, OpenVINO departs by up to 1.24x the file's rounding, saturating by 3-11x. Beyond
the bound a runtime whose kernels lack VNNI saturates; one with VNNI reads the graph otherwise."""


def check_int8(int8_model: bytes, fp32_model: bytes, batches: Sequence[np.ndarray]) -> Int8Checks:
    """Full checker, then the INT8 and FP32 files on ``batches``: the largest absolute
    difference of their outputs and the FP32 outputs' scale, in onnxruntime and in OpenVINO,
    each also against the file's own arithmetic (``runtimes``; docs/int8.md, "Every x86
    CPU"). A runtime that departs from that arithmetic beyond its bound (``DEPARTURE_SHARE``)
    is named as saturating where its kernels lack VNNI (``saturates``). Raises
    ``ExportError`` when the file fails the checker, does not run, gives non-finite or
    misshapen outputs, or a runtime with VNNI departs from its arithmetic."""
    import onnx

    warm_openvino()  # OpenVINO loads in its own process (when not yet running) while the checker runs
    try:
        onnx.checker.check_model(onnx.load_from_string(int8_model), full_check=True)
    except Exception as exc:  # noqa: BLE001 - the checker raises its own types
        raise ExportError(f"INT8 model fails onnx.checker: {first_line(exc)}; no file written") from exc
    try:
        quantized, reference = session(int8_model), session(fp32_model)
        arithmetic = qdq_arithmetic(int8_model)
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"onnxruntime cannot load the INT8 model: {first_line(exc)}; no file written") from exc
    name = quantized.get_inputs()[0].name
    fixed = fixed_batch(quantized)
    if fixed is not None:  # a model exported at a static batch runs only there
        batches = [batch[:fixed] for batch in batches if len(batch) >= fixed]
    in_openvino = _start_openvino(int8_model, batches)  # runs in OpenVINO's process beside onnxruntime's runs here
    got_all, expected_all, own_all = [], [], []
    for batch in batches:
        try:
            got_all.append(quantized.run(None, {name: batch}))
            own_all.append(arithmetic.run(None, {name: batch}))
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"onnxruntime fails on the INT8 model: {first_line(exc)}; no file written") from exc
        expected_all.append(reference.run(None, {reference.get_inputs()[0].name: batch}))
    try:
        worst, scale = largest_difference(got_all, expected_all)
        own, _ = largest_difference(own_all, expected_all)
    except ValueError as exc:
        raise ExportError(f"INT8 {exc}; no file written") from exc
    judge = _Judge(own_all, expected_all, max(DEPARTURE_SHARE * scale, 2 * own), cpu_features())
    onnxruntime = RuntimeEntry(ran=True, version=onnxruntime_version(), max_abs_diff=worst,
                               **judge("onnxruntime", got_all))
    openvino = _openvino(in_openvino, got_all, judge)
    return Int8Checks(
        max_abs_diff=worst, fp32_max_abs=scale, qdq_max_abs_diff=own,
        runtimes=RuntimeChecks(reference="the FP32 export in onnxruntime, on the verified batches",
                               onnxruntime=onnxruntime, openvino=openvino),
        cpu=judge.cpu,
        saturates=[runtime for runtime, entry in (("onnxruntime", onnxruntime), ("openvino", openvino))
                   if entry.saturates],
    )


def qdq_arithmetic(int8_model: bytes):
    """The file's own arithmetic: onnxruntime with graph optimizations off runs each
    DequantizeLinear, the float op and QuantizeLinear as written, so no 8-bit kernel (and no
    16-bit pair sum) takes part: what the file computes on any CPU that does not saturate."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = min(4, os.cpu_count() or 1)
    return onnxruntime.InferenceSession(int8_model, options, providers=["CPUExecutionProvider"])


@dataclass(frozen=True)
class _Judge:
    """Judges a runtime's INT8 outputs against the file's own arithmetic on the same batches."""

    own: list
    fp32: list
    allowed: float
    cpu: CpuFeatures

    def __call__(self, runtime: str, outputs: list) -> dict:
        """``RuntimeEntry``'s judgement fields for ``runtime``'s ``outputs``; raises
        ``ExportError`` where a runtime with VNNI departs from the file's arithmetic."""
        departure, _ = largest_difference(outputs, self.own)
        if departure <= self.allowed:
            return {"max_abs_diff_to_qdq": departure, "saturates": False}
        said = (f"the INT8 model's outputs in {RUNTIME_NAMES[runtime]} depart from its own Q/DQ arithmetic by "
                f"{departure:.3g} (allowed {self.allowed:.3g}: {DEPARTURE_SHARE:.0%} of the outputs' scale or twice "
                "the file's own rounding)")
        if self.cpu.has_vnni(runtime):
            raise ExportError(f"{said} on a CPU with VNNI: {RUNTIME_NAMES[runtime]} reads the graph otherwise; "
                              "no file written")
        return {"max_abs_diff_to_qdq": departure, "saturates": True,
                "reason": f"{said}: its 8-bit kernels saturate on this CPU without VNNI ({self.cpu.describe()}); "
                          "7-bit weights (int8.reduce_range, the default for CPU targets) cannot"}


RUNTIME_NAMES = {"onnxruntime": "onnxruntime", "openvino": "OpenVINO"}


def _start_openvino(int8_model: bytes, batches: Sequence[np.ndarray]) -> Future[RuntimeRun] | RuntimeEntry:
    """The file's run in OpenVINO begun (``start_openvino``), or the entry saying why
    OpenVINO cannot read it."""
    import onnx

    if any(node.domain == "com.microsoft" for node in onnx.load_from_string(int8_model).graph.node):
        return RuntimeEntry(ran=False, reason="16-bit Q/DQ before opset 21 are onnxruntime's own (com.microsoft) "
                            "ops, which OpenVINO does not read")
    return start_openvino(int8_model, batches)


def _openvino(started: Future[RuntimeRun] | RuntimeEntry, onnxruntime_outputs: list, judge: _Judge) -> RuntimeEntry:
    """OpenVINO's entry: its largest difference from the FP32 export, from onnxruntime's INT8
    outputs, and its judgement against the file's own arithmetic."""
    if isinstance(started, RuntimeEntry):
        return started
    try:
        run = started.result()
    except (RuntimeError, ValueError) as exc:
        raise ExportError(f"the INT8 model fails in OpenVINO: {first_line(exc)}; no file written") from exc
    if run.outputs is None:
        return runtime_entry(run)
    try:
        diff, _ = largest_difference(run.outputs, judge.fp32)
        agreement, _ = largest_difference(run.outputs, onnxruntime_outputs)
    except ValueError as exc:
        raise ExportError(f"the INT8 model fails in OpenVINO: {first_line(exc)}; no file written") from exc
    return runtime_entry(run, diff, max_abs_diff_to_onnxruntime=agreement, **judge("openvino", run.outputs))


@dataclass(frozen=True)
class LabelledBatches:
    """Evaluation data held for repeated measurement: float32 batches and int64 labels."""

    batches: list[np.ndarray]
    labels: list[np.ndarray]

    @property
    def samples(self) -> int:
        """How many samples the batches hold."""
        return sum(len(labels) for labels in self.labels)


def latency_ms(model: bytes, sample: np.ndarray, *, budget_s: float = 0.25, runs: int = 50) -> float:
    """onnxruntime's median latency (milliseconds) on one batch ``sample``, as deployed (full
    graph optimizations, one intra-op thread: a server answering requests side by side), after
    warm-up runs; at most ``runs`` runs or about ``budget_s``, at least 5. Measured on a 224x224
    resnet18 (16 ms a run, 15 runs): six medians within 1.7% of each other at 0.25 s, 0.9% at
    0.5 s, 17.6% at 0.15 s."""
    import time

    runner = session(model, threads=1)
    feed = {runner.get_inputs()[0].name: sample}
    for _ in range(3):
        runner.run(None, feed)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < runs and (len(times) < 5 or time.perf_counter() < deadline):
        started = time.perf_counter()
        runner.run(None, feed)
        times.append(time.perf_counter() - started)
    return 1000.0 * float(np.median(times))
