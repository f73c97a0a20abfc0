"""One OpenVINO process per checking process (service/export/openvino_process.py): reused for
every file, replaced when it dies or when oneDNN's ISA cap changes, a check retried once on a
fresh one, and OpenVINO's own errors said in one line without losing the process; started
ahead (``warm``) and run beside this process (``start_openvino``)."""

from __future__ import annotations

import os
import signal

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from bnrecal.service.export.openvino_process import PROCESS
from bnrecal.service.export.runtimes import run_openvino, start_openvino


def scaled(factor: float) -> bytes:
    """``y = relu(x) * factor`` over a dynamic batch of 4 values."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [1], [factor])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "scale"], ["y"])],
                              "scaled", [x], [y], [scale])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


BATCHES = [np.array([[-1.0, 0.5, 2.0, -3.0]], np.float32), np.arange(8, dtype=np.float32).reshape(2, 4) - 4]


def expected(factor: float) -> list[np.ndarray]:
    return [np.maximum(batch, 0) * factor for batch in BATCHES]


def outputs(factor: float) -> list[np.ndarray]:
    return [out[0] for out in run_openvino(scaled(factor), BATCHES).outputs]


def test_one_process_checks_every_file_and_a_killed_one_is_replaced_and_the_check_retried():
    for got, want in zip(outputs(2.0), expected(2.0)):
        np.testing.assert_allclose(got, want)
    first, starts = PROCESS.pid(), PROCESS.starts
    assert first is not None and first != os.getpid()
    for factor in (3.0, 0.5):
        for got, want in zip(outputs(factor), expected(factor)):
            np.testing.assert_allclose(got, want)
    assert PROCESS.pid() == first and PROCESS.starts == starts  # the same child, no new Python
    os.kill(first, signal.SIGKILL)  # dies between checks: the next check finds it gone
    for got, want in zip(outputs(4.0), expected(4.0)):
        np.testing.assert_allclose(got, want)
    assert PROCESS.pid() not in (None, first) and PROCESS.starts == starts + 1


def test_openvinos_error_is_one_line_and_keeps_the_process():
    outputs(1.0)
    alive = PROCESS.pid()
    broken = onnx.load_from_string(scaled(1.0))
    broken.graph.node[1].op_type = "NoSuchOp"
    with pytest.raises(RuntimeError, match="OpenVINO cannot compile the model") as caught:
        run_openvino(broken.SerializeToString(), BATCHES)
    assert "\n" not in str(caught.value)
    assert PROCESS.pid() == alive


def test_a_new_isa_cap_starts_a_process_under_it(monkeypatch):
    outputs(1.0)
    before = PROCESS.pid()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    outputs(1.0)
    capped = PROCESS.pid()
    assert capped != before
    with open(f"/proc/{capped}/environ", "rb") as environ:
        assert b"ONEDNN_MAX_CPU_ISA=AVX2" in environ.read().split(b"\0")


def test_a_process_that_dies_mid_check_is_replaced_and_the_check_retried_once():
    """The child ends after taking the request (as a crash inside OpenVINO would): the check
    runs again on a fresh child and succeeds."""
    import subprocess
    import sys

    outputs(1.0)

    def dying() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline(); sys.exit(3)"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    PROCESS.close()
    PROCESS._child = dying()  # noqa: SLF001 - a real process standing in for a crashing OpenVINO
    PROCESS._started_under = tuple(os.environ.get(name) for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"))  # noqa: SLF001
    starts = PROCESS.starts
    for got, want in zip(outputs(5.0), expected(5.0)):
        np.testing.assert_allclose(got, want)
    assert PROCESS.starts == starts + 1


def test_a_process_warmed_ahead_is_the_one_the_first_check_uses_and_one_that_died_is_replaced():
    PROCESS.close()
    PROCESS.warm()  # returns at once; OpenVINO loads in the child meanwhile
    warmed, starts = PROCESS.pid(), PROCESS.starts
    assert warmed is not None
    PROCESS.warm()  # one is running: nothing new
    for got, want in zip(outputs(2.0), expected(2.0)):
        np.testing.assert_allclose(got, want)
    assert PROCESS.pid() == warmed and PROCESS.starts == starts
    PROCESS.close()
    PROCESS.warm()
    os.kill(PROCESS.pid(), signal.SIGKILL)  # dies before it said it was ready
    for got, want in zip(outputs(3.0), expected(3.0)):
        np.testing.assert_allclose(got, want)
    assert PROCESS.starts == starts + 2


def test_a_check_started_beside_this_process_gives_its_run_or_its_error():
    started = [start_openvino(scaled(factor), BATCHES) for factor in (2.0, 0.5)]  # queued on the one process
    for future, factor in zip(started, (2.0, 0.5)):
        for got, want in zip([out[0] for out in future.result(timeout=120).outputs], expected(factor)):
            np.testing.assert_allclose(got, want)
    broken = onnx.load_from_string(scaled(1.0))
    broken.graph.node[1].op_type = "NoSuchOp"
    with pytest.raises(RuntimeError, match="OpenVINO cannot compile the model"):
        start_openvino(broken.SerializeToString(), BATCHES).result(timeout=120)
