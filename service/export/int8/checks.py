"""The INT8 file checked like the FP32 export (docs/onnx.md, "The file"; docs/int8.md,
"Checks and the report's `int8` section"): ``onnx.checker`` full check, runs in
onnxruntime, its outputs against the FP32 export's on calibration samples; its latency;
and the labelled evaluation data the Python API holds in memory (scored by the passes of
``workers.ranks.ort.rank_pass``, as the ranks score theirs).

Sessions here run with onnxruntime's default graph optimizations, as a deployment runs
the file: that is where QuantizeLinear/DequantizeLinear pairs become INT8 kernels.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bnrecal.errors import ExportError, first_line
from bnrecal.workers.engine.ranges import fixed_batch
from bnrecal.workers.ranks.ort.rank_pass import scoring_session

from bnrecal.service.export.report_sections import Int8Checks, RuntimeChecks, RuntimeEntry
from bnrecal.service.export.runtimes import (
    cpu_saturates_int8,
    largest_difference,
    onnxruntime_version,
    run_openvino,
    runtime_entry,
)


def session(model: bytes, threads: int | None = None):
    """An onnxruntime CPU session with the default (full) graph optimizations."""
    return scoring_session(model, threads or min(4, os.cpu_count() or 1))


OPENVINO_SLACK = 0.01
"""OpenVINO's INT8 outputs may differ from the FP32 export's by at most twice onnxruntime's
largest difference plus this share of the outputs' scale: the runtimes round requantized
values in their own kernels, a graph read differently is off by the outputs' scale."""


def check_int8(int8_model: bytes, fp32_model: bytes, batches: Sequence[np.ndarray]) -> Int8Checks:
    """Full checker, then the INT8 and FP32 files on ``batches``: the largest absolute
    difference of their outputs and the FP32 outputs' scale, in onnxruntime and in OpenVINO
    (``runtimes``). Raises ``ExportError`` when the file fails the checker, does not run,
    gives non-finite or misshapen outputs, or OpenVINO's outputs stray from the FP32 export's
    by more than ``OPENVINO_SLACK`` allows."""
    import onnx

    try:
        onnx.checker.check_model(onnx.load_from_string(int8_model), full_check=True)
    except Exception as exc:  # noqa: BLE001 - the checker raises its own types
        raise ExportError(f"INT8 model fails onnx.checker: {first_line(exc)}; no file written") from exc
    try:
        quantized, reference = session(int8_model), session(fp32_model)
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"onnxruntime cannot load the INT8 model: {first_line(exc)}; no file written") from exc
    name = quantized.get_inputs()[0].name
    fixed = fixed_batch(quantized)
    if fixed is not None:  # a model exported at a static batch runs only there
        batches = [batch[:fixed] for batch in batches if len(batch) >= fixed]
    got_all, expected_all = [], []
    for batch in batches:
        try:
            got_all.append(quantized.run(None, {name: batch}))
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"onnxruntime fails on the INT8 model: {first_line(exc)}; no file written") from exc
        expected_all.append(reference.run(None, {reference.get_inputs()[0].name: batch}))
    try:
        worst, scale = largest_difference(got_all, expected_all)
    except ValueError as exc:
        raise ExportError(f"INT8 {exc}; no file written") from exc
    return Int8Checks(max_abs_diff=worst, fp32_max_abs=scale,
                      runtimes=_openvino_agreement(int8_model, batches, got_all, expected_all, worst))


def _openvino_agreement(int8_model: bytes, batches: Sequence[np.ndarray], onnxruntime_outputs: list,
                        fp32_outputs: list, onnxruntime_diff: float) -> RuntimeChecks:
    """The report's ``runtimes``: each runtime's largest difference from the FP32 export (in
    onnxruntime), and OpenVINO's from onnxruntime's INT8 outputs."""
    import onnx

    if any(node.domain == "com.microsoft" for node in onnx.load_from_string(int8_model).graph.node):
        openvino = RuntimeEntry(ran=False, reason="16-bit Q/DQ before opset 21 are onnxruntime's own (com.microsoft) "
                                "ops, which OpenVINO does not read")
        return _runtimes(onnxruntime_diff, openvino)
    try:
        run = run_openvino(int8_model, batches)
        if run.outputs is None:
            openvino = runtime_entry(run)
        else:
            diff, scale = largest_difference(run.outputs, fp32_outputs)
            agreement, _ = largest_difference(run.outputs, onnxruntime_outputs)
            allowed = 2 * onnxruntime_diff + OPENVINO_SLACK * max(1.0, scale)
            strayed = (f"the INT8 model differs in OpenVINO from the FP32 export by {diff:.3g}, onnxruntime by "
                       f"{onnxruntime_diff:.3g} (allowed {allowed:.3g})")
            if diff <= allowed:
                openvino = runtime_entry(run, diff, max_abs_diff_to_onnxruntime=agreement)
            elif cpu_saturates_int8():  # this CPU's arithmetic, not the file: said in the report, not failed
                openvino = runtime_entry(run, diff, max_abs_diff_to_onnxruntime=agreement, judged=False,
                                         reason=f"{strayed} on a CPU without VNNI, whose 8-bit dot products "
                                         "saturate in OpenVINO: that judges the CPU, not the file")
            else:
                raise ExportError(f"{strayed}: OpenVINO reads the graph otherwise; no file written")
    except (RuntimeError, ValueError) as exc:
        raise ExportError(f"the INT8 model fails in OpenVINO: {first_line(exc)}; no file written") from exc
    return _runtimes(onnxruntime_diff, openvino)


def _runtimes(onnxruntime_diff: float, openvino: RuntimeEntry) -> RuntimeChecks:
    return RuntimeChecks(
        reference="the FP32 export in onnxruntime, on the verified batches",
        onnxruntime=RuntimeEntry(ran=True, version=onnxruntime_version(), max_abs_diff=onnxruntime_diff),
        openvino=openvino,
    )


@dataclass(frozen=True)
class LabelledBatches:
    """Evaluation data held for repeated measurement: float32 batches and int64 labels."""

    batches: list[np.ndarray]
    labels: list[np.ndarray]

    @property
    def samples(self) -> int:
        """How many samples the batches hold."""
        return sum(len(labels) for labels in self.labels)


def latency_ms(model: bytes, sample: np.ndarray, *, budget_s: float = 0.5, runs: int = 50) -> float:
    """onnxruntime's median latency (milliseconds) on one batch ``sample``, as deployed (full
    graph optimizations, one intra-op thread: a server answering requests side by side), after
    warm-up runs; at most ``runs`` runs or about ``budget_s``."""
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
