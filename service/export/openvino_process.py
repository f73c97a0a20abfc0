"""One OpenVINO process per process that checks exported files, reused for every file
(docs/onnx.md, "The file"): OpenVINO is never loaded into a process that runs torch and Ray
(loaded into the driver or a job host it corrupted that process's memory later on: a segfault
in a later test, reproduced with four command-line test files, none without OpenVINO), and
starting a Python that imports OpenVINO costs 1-1.5 s a file.

The child reads one folder path a line on its standard input (``model.onnx`` and
``batches.npz`` in it), compiles and runs the model, writes ``outputs.npz`` there and answers
one line: ``ok``, or ``error`` and the one-line reason (a path after ``ir `` is converted to
OpenVINO's own files first, ``model.xml`` and ``model.bin``, and both run). It ends when its
input closes (its parent gone). A child that dies mid-check (a crash in OpenVINO, a kill) is
replaced and the check tried once more; a second death is the check's error. A child started under another
``ONEDNN_MAX_CPU_ISA`` (oneDNN reads it once, at start) is replaced by one started under the
current value. ``warm`` starts the child without waiting for it, so OpenVINO loads on a free
core while the exporter traces; the first check then only reads its ``ready``.
"""

from __future__ import annotations

import atexit
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

_CHILD = """
import os, sys
import numpy as np
import openvino as ov
def said(exc):
    # OpenVINO's messages open with "Exception from src/...cpp:N:" lines; the cause follows
    lines = [l.strip() for l in str(exc).splitlines() if l.strip() and not l.strip().startswith("Exception from ")]
    return " ".join(lines)[:400] or type(exc).__name__
def check(folder, model="model.onnx", saved="outputs.npz"):
    batches = np.load(os.path.join(folder, "batches.npz"))
    config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": min(4, os.cpu_count() or 1)}
    try:
        compiled = core.compile_model(core.read_model(os.path.join(folder, model)), "CPU", config)
    except Exception as exc:
        return "OpenVINO cannot compile the model: " + said(exc)
    request = compiled.create_infer_request()
    outputs = {}
    for b in range(len(batches.files)):
        batch = batches[f"b{b}"]
        try:
            result = request.infer({0: batch})
        except Exception as exc:
            return f"OpenVINO fails on a batch of {len(batch)}: " + said(exc)
        for i, port in enumerate(compiled.outputs):
            outputs[f"b{b}_o{i}"] = np.array(result[port])
    np.savez(os.path.join(folder, saved), **outputs)
    return None
def convert(folder):
    # OpenVINO's own files of the ONNX file, then each run: the ONNX file as read, the IR as written
    try:
        ov.save_model(core.read_model(os.path.join(folder, "model.onnx")), os.path.join(folder, "model.xml"),
                      compress_to_fp16=False)
    except Exception as exc:
        return "OpenVINO cannot convert the model: " + said(exc)
    return check(folder, "model.onnx", "onnx_outputs.npz") or check(folder, "model.xml", "outputs.npz")
core = ov.Core()
print("ready", flush=True)
for line in sys.stdin:
    folder = line.rstrip("\\n")
    try:
        failure = convert(folder[3:]) if folder.startswith("ir ") else check(folder)
    except Exception as exc:
        failure = "OpenVINO's check fails: " + said(exc)
    print("ok" if failure is None else "error " + failure.replace("\\n", " "), flush=True)
"""

TIMEOUT_S = 600.0
"""The longest one file's compile and run may take before its child is taken as hung."""

ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


class OpenVinoProcess:
    """A child Python with OpenVINO loaded, answering checks one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: subprocess.Popen[str] | None = None
        self._started_under: tuple[str | None, ...] | None = None
        self._ready_read = False
        self.starts = 0

    def warm(self) -> None:
        """Start the child now and return at once (nothing when one runs or a check is under
        way): OpenVINO loads in it while this process goes on; the next check waits for it."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._spawn()
        finally:
            self._lock.release()

    def run(self, folder: Path, *, convert: bool = False) -> None:
        """Run the check of ``folder`` (``model.onnx``, ``batches.npz`` -> ``outputs.npz``);
        with ``convert``, first write OpenVINO's own files of it (``model.xml``, ``model.bin``)
        and run both, the ONNX file's outputs in ``onnx_outputs.npz`` and the IR's in
        ``outputs.npz``. Raises ``RuntimeError`` with one line when OpenVINO cannot convert,
        compile or run the model, or when its process dies twice on it."""
        line = f"ir {folder}" if convert else str(folder)
        with self._lock:
            try:
                answer = self._ask(line)
            except _ChildDied:
                try:
                    answer = self._ask(line)  # a fresh child, once
                except _ChildDied as again:
                    raise RuntimeError(f"OpenVINO's process ended twice on this model ({again})") from None
        if answer != "ok":
            raise RuntimeError(answer.removeprefix("error ").strip() or "OpenVINO's check failed")

    def pid(self) -> int | None:
        """The child's process id, or None before the first check."""
        return self._child.pid if self._child is not None and self._child.poll() is None else None

    def close(self) -> None:
        """End the child (its input closed, then killed if it lingers)."""
        child, self._child = self._child, None
        if child is None:
            return
        try:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            child.kill()
            child.wait()

    def _ask(self, line: str) -> str:
        child = self._ready()
        try:
            assert child.stdin is not None
            child.stdin.write(f"{line}\n")
            child.stdin.flush()
            return self._read_line(child)
        except (BrokenPipeError, OSError) as exc:
            self.close()
            raise _ChildDied(f"{type(exc).__name__}") from None

    def _spawn(self) -> subprocess.Popen[str]:
        """The child for the current ISA cap, started if there is none (not waited for)."""
        under = tuple(os.environ.get(name) for name in ISA_CAP_VARIABLES)
        if self._child is not None and (self._child.poll() is not None or under != self._started_under):
            self.close()
        if self._child is None:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True, bufsize=1,
            )
            self._started_under, self._ready_read = under, False
            self.starts += 1
        return self._child

    def _ready(self) -> subprocess.Popen[str]:
        child = self._spawn()
        if not self._ready_read:
            if self._read_line(child) != "ready":  # one that died before it is replaced by run(), once
                self.close()
                raise RuntimeError("OpenVINO's process did not start")
            self._ready_read = True
        return child

    def _read_line(self, child: subprocess.Popen[str]) -> str:
        assert child.stdout is not None
        readable, _, _ = select.select([child.stdout], [], [], TIMEOUT_S)
        if not readable:
            self.close()
            raise _ChildDied(f"no answer within {TIMEOUT_S:.0f} s")
        line = child.stdout.readline()
        if not line:
            code = child.wait()
            self.close()
            raise _ChildDied(f"it ended with code {code}")
        return line.rstrip("\n")


class _ChildDied(Exception):
    """The child ended (or hung) before answering."""


PROCESS = OpenVinoProcess()
"""This process's OpenVINO process (one per driver, job host or rank)."""

atexit.register(PROCESS.close)
