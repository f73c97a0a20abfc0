"""The exported files run in a second runtime, OpenVINO (its CPU plugin, dynamic batch),
beside onnxruntime (docs/onnx.md, "The file"; docs/int8.md, "Checks and the report's `int8` section").

onnxruntime alone can accept a graph another deployer's runtime reads differently (a
memory-format subgraph that OpenVINO computed wrong at a dynamic batch showed this), so
every file is also compiled and run by OpenVINO on the batches onnxruntime verified, and
compared with the same reference at the same tolerance. OpenVINO computes float layers in
float32 here (``INFERENCE_PRECISION_HINT: f32``): its CPU plugin would otherwise pick
bfloat16 on CPUs that have it, and judge the file at a precision it was not written in.

OpenVINO is optional (the ``openvino`` extra; ``make serve`` installs it); without it the report says
``{"ran": false, "reason": "openvino is not installed"}`` and only onnxruntime judges the file.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bnrecal.service.export.report_sections import RuntimeEntry


OPENVINO_CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}


@dataclass(frozen=True)
class RuntimeRun:
    """One runtime's outputs on each batch, or why it did not run (``outputs`` None)."""

    runtime: str
    version: str
    outputs: list[list[np.ndarray]] | None
    reason: str = ""


def openvino_version() -> str | None:
    """OpenVINO's version, or None when it is not installed (read from its package
    metadata: OpenVINO itself is only ever loaded in a child process, below)."""
    from importlib import metadata

    try:
        return metadata.version("openvino").split("-")[0]
    except metadata.PackageNotFoundError:
        return None


def run_openvino(model: Path | bytes, batches: Sequence[np.ndarray]) -> RuntimeRun:
    """Compile ``model`` (a file or serialized bytes) for OpenVINO's CPU plugin as written
    (dynamic batch kept dynamic) and run it on each batch, in this process's OpenVINO process
    (``openvino_process``: one per process, reused). Raises ``RuntimeError`` with one line
    when OpenVINO cannot read, compile or run it."""
    import tempfile

    from bnrecal.service.export.openvino_process import PROCESS

    version = openvino_version()
    if version is None:
        return RuntimeRun("openvino", "", None, "openvino is not installed")
    with tempfile.TemporaryDirectory(prefix="bnrecal-openvino-") as folder:
        target = Path(folder, "model.onnx")
        target.write_bytes(model.read_bytes() if isinstance(model, Path) else model)
        np.savez(Path(folder, "batches.npz"), **{f"b{b}": batch for b, batch in enumerate(batches)})
        PROCESS.run(Path(folder))
        outputs = saved_outputs(Path(folder, "outputs.npz"), len(batches))
    return RuntimeRun("openvino", version, outputs)


def saved_outputs(path: Path, batches: int) -> list[list[np.ndarray]]:
    """The outputs OpenVINO's process saved (``b{batch}_o{output}``), per batch, in the
    model's output order."""
    with np.load(path) as saved:
        count = len({name.split("_")[1] for name in saved.files}) if saved.files else 0
        return [[saved[f"b{b}_o{i}"] for i in range(count)] for b in range(batches)]


def warm_openvino() -> None:
    """Start this process's OpenVINO process ahead of its first check, where OpenVINO is
    installed: it loads on a free core while the export is traced."""
    from bnrecal.service.export.openvino_process import PROCESS

    if openvino_version() is not None:
        PROCESS.warm()


def start_openvino(model: bytes, batches: Sequence[np.ndarray]) -> Future[RuntimeRun]:
    """``run_openvino`` begun in a thread: OpenVINO's process computes while this process
    runs the same file in onnxruntime; the future holds its run or its error."""
    future: Future[RuntimeRun] = Future()

    def check() -> None:
        try:
            future.set_result(run_openvino(model, batches))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=check, name="bnrecal-openvino-check", daemon=True).start()
    return future


def largest_difference(got: Sequence[Sequence[np.ndarray]], expected: Sequence[Sequence[np.ndarray]]) -> tuple[float, float]:
    """The largest ``|got - expected|`` over every batch and floating output, and the largest
    ``|expected|`` (the outputs' scale). Raises ``ValueError`` naming the first output whose
    count, shape or finiteness differs."""
    worst = scale = 0.0
    for b, (outs, refs) in enumerate(zip(got, expected, strict=True)):
        if len(outs) != len(refs):
            raise ValueError(f"returns {len(outs)} outputs, expected {len(refs)}")
        for index, (a, r) in enumerate(zip(outs, refs)):
            if a.shape != r.shape:
                raise ValueError(f"output {index} has shape {list(a.shape)} at batch {b}, expected {list(r.shape)}")
            if not np.issubdtype(r.dtype, np.floating) or r.size == 0:
                continue
            if not np.all(np.isfinite(a)):
                raise ValueError(f"output {index} is not finite")
            worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - r.astype(np.float64)))))
            scale = max(scale, float(np.max(np.abs(r))))
    return worst, scale


def runtime_entry(run: RuntimeRun, max_abs_diff: float | None = None, **judgement: Any) -> RuntimeEntry:
    """The report's entry for one runtime: whether it ran the file, its version, its
    agreement (``max_abs_diff`` against the reference named by the section), and for an INT8
    file the ``judgement`` of its arithmetic (``RuntimeEntry``'s other fields)."""
    if run.outputs is None:
        return RuntimeEntry(ran=False, reason=run.reason)
    return RuntimeEntry(ran=True, version=run.version, max_abs_diff=max_abs_diff, **judgement)


def onnxruntime_version() -> str:
    """onnxruntime's version."""
    import onnxruntime

    return str(onnxruntime.__version__)
