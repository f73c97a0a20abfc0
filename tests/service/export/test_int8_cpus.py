"""INT8 files that keep their accuracy on every x86 CPU (docs/int8.md, "Every x86 CPU"), on a
real trained model: the digits demo's resnet18, recalibrated, scored on its 360 held-out scans.

A CPU without VNNI is had on a VNNI CPU for OpenVINO: its CPU plugin dispatches through
oneDNN, which honours ``ONEDNN_MAX_CPU_ISA``, so ``AVX2`` runs OpenVINO's INT8 kernels as an
AVX2-only Intel CPU does (``VPMADDUBSW``, 16-bit pair sums), saturation included; on a CPU
that is AVX2-only already the cap lowers nothing (an AMD EPYC's OpenVINO did not saturate),
so the tests that saturate by the cap are ``vnni``. onnxruntime has no such cap: its
saturation is tested where the CPU itself lacks VNNI (``no_vnni``), and what 8-bit weights
are for where it has VNNI (``vnni``).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torchvision

from bnrecal.errors import Int8GuardError
from bnrecal.workers.data import describe_dataset

from bnrecal.service.cli.console import int8_line
from bnrecal.service.export.int8.checks import LabelledBatches
from bnrecal.service.export.int8.options import int8_options
from bnrecal.service.export.runtimes import run_openvino
from bnrecal.service.run.outputs.int8 import quantize_export
from bnrecal.service.run.outputs.onnx_passes import InProcessPasses
from tests.service.export.int8_helpers import fp32_export

BATCH = 64
WITHOUT_VNNI = {"ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.fixture(scope="module")
def digits(demo_inputs, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The demo's stale resnet18 recalibrated by ``update_bn`` on the new camera's scans, its
    folded export, the calibration data and the labelled held-out scans."""
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(torch.load(demo_inputs.checkpoint, weights_only=True)["model"])
    calib = torch.from_numpy(np.load(demo_inputs.calib))
    torch.optim.swa_utils.update_bn([(calib[i : i + BATCH],) for i in range(0, len(calib), BATCH)], model)
    fp32 = fp32_export(model, calib, tmp_path_factory.mktemp("digits") / "fp32.onnx")
    held = np.load(demo_inputs.eval)
    x, y = held["x"].astype(np.float32), held["y"].astype(np.int64)
    evaluation = LabelledBatches([x[i : i + BATCH] for i in range(0, len(x), BATCH)],
                                 [y[i : i + BATCH] for i in range(0, len(y), BATCH)])
    session = ort.InferenceSession(fp32, providers=["CPUExecutionProvider"])
    fp32_top1 = float(np.mean(np.concatenate([session.run(None, {"input": b})[0] for b in evaluation.batches])
                              .argmax(axis=1) == y))  # FP32's top-1 in onnxruntime, counted here once
    return SimpleNamespace(fp32=fp32, dataset=describe_dataset(demo_inputs.calib), verify=calib[:8],
                           evaluation=evaluation, fp32_top1=fp32_top1)


def top1_in_runtimes(model: bytes, evaluation: LabelledBatches) -> dict[str, float]:
    """The file's top-1 on the held-out scans, counted here in each runtime as deployed:
    onnxruntime (full optimizations), OpenVINO, and OpenVINO as on a CPU without VNNI."""
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    labels = np.concatenate(evaluation.labels)
    scores = {"onnxruntime": np.concatenate([session.run(None, {"input": x})[0] for x in evaluation.batches])}
    scores["openvino"] = np.concatenate([out[0] for out in run_openvino(model, evaluation.batches).outputs])
    with pytest.MonkeyPatch.context() as patch:
        for name, value in WITHOUT_VNNI.items():
            patch.setenv(name, value)
        scores["openvino without VNNI"] = np.concatenate(
            [out[0] for out in run_openvino(model, evaluation.batches).outputs])
    return {runtime: float(np.mean(s.argmax(axis=1) == labels)) for runtime, s in scores.items()}


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy"])
def test_the_default_file_keeps_fp32_top1_within_a_point_in_both_runtimes_with_or_without_vnni(digits, method):
    quantized = quantize_export(digits.fp32, int8_options({"method": method}),
                                InProcessPasses(digits.dataset, BATCH, evaluation=digits.evaluation), digits.verify)
    section = quantized.section
    assert section["reduce_range"] is True and "7-bit" in section["weights"]
    fp32 = digits.fp32_top1
    assert section["evaluation"]["fp32"]["top1"] == pytest.approx(fp32)
    for runtime, top1 in top1_in_runtimes(quantized.model, digits.evaluation).items():
        assert fp32 - top1 <= 0.01, (runtime, fp32, top1)
    assert section["saturates"] == [] and section["cpu"]["model"]


@pytest.mark.vnni  # the cap must lower the ISA: on a CPU that is AVX2 already it changes no kernel
def test_8_bit_weights_saturate_in_openvino_without_vnni_and_the_file_says_so(digits, monkeypatch):
    """Full 8-bit weights stay writable (for CPUs with VNNI). On OpenVINO capped below VNNI
    (as on an Intel CPU without it) the file's outputs depart from its own Q/DQ arithmetic far
    beyond rounding and lose accuracy: the report names OpenVINO as saturating, with why, and
    the console line says so; the same options on the default 7-bit weights do not saturate.
    (On an AMD EPYC with AVX2 alone, OpenVINO's kernels were measured not to saturate: the
    report then rightly names nothing, which the ``no_vnni`` test below holds.)"""
    options = int8_options({"reduce_range": False})
    passes = InProcessPasses(digits.dataset, BATCH)  # the checks need no evaluation data: the top-1 is counted below
    for name, value in WITHOUT_VNNI.items():
        monkeypatch.setenv(name, value)
    quantized = quantize_export(digits.fp32, options, passes, digits.verify)
    section = quantized.section
    assert section["written"] is True and section["cpu"]["openvino_isa_cap"] == "AVX2"
    assert "openvino" in section["saturates"]
    openvino = section["runtimes"]["openvino"]
    assert openvino["saturates"] is True and "saturate on this CPU without VNNI" in openvino["reason"]
    allowed = max(0.05 * section["fp32_max_abs"], 2 * section["qdq_max_abs_diff"])
    assert openvino["max_abs_diff_to_qdq"] > 2 * allowed  # not a rounding matter
    assert "SATURATES in openvino" in int8_line(section) and "OpenVINO capped at AVX2" in int8_line(section)
    for name in WITHOUT_VNNI:
        monkeypatch.delenv(name)
    scores = top1_in_runtimes(quantized.model, digits.evaluation)
    assert scores["openvino without VNNI"] < scores["openvino"]  # the saturation costs accuracy, measured
    for name, value in WITHOUT_VNNI.items():
        monkeypatch.setenv(name, value)
    seven = quantize_export(digits.fp32, int8_options({}), passes, digits.verify).section
    assert seven["saturates"] == [] and seven["runtimes"]["openvino"]["saturates"] is False


@pytest.mark.vnni
def test_on_a_cpu_with_vnni_8_bit_weights_keep_their_accuracy_in_both_runtimes(digits):
    """What full 8-bit weights are for: with VNNI neither runtime's kernels saturate, and the
    file keeps FP32's top-1 within a point in onnxruntime and OpenVINO."""
    quantized = quantize_export(digits.fp32, int8_options({"reduce_range": False}),
                                InProcessPasses(digits.dataset, BATCH, evaluation=digits.evaluation), digits.verify)
    section = quantized.section
    assert section["weights"].endswith("8-bit") and section["saturates"] == [] and section["cpu"]["vnni"] is True
    fp32 = section["evaluation"]["fp32"]["top1"]
    scores = top1_in_runtimes(quantized.model, digits.evaluation)
    assert fp32 - scores["onnxruntime"] <= 0.01 and fp32 - scores["openvino"] <= 0.01, scores


@pytest.mark.vnni  # it saturates by the cap above, which needs a CPU the cap lowers
def test_a_guard_refuses_a_file_that_saturates(digits, monkeypatch):
    """With ``max_top1_drop`` set, a file saturating in a runtime the guard's measurement does
    not see is not written: its INT8 output fails saying why, and what to do."""
    for name, value in WITHOUT_VNNI.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(Int8GuardError, match="saturates in openvino.*7-bit weights") as caught:
        quantize_export(digits.fp32, int8_options({"reduce_range": False, "max_top1_drop": 2.0}),
                        InProcessPasses(digits.dataset, BATCH, evaluation=digits.evaluation), digits.verify)
    section = caught.value.section
    assert section["written"] is False and section["saturates"] == ["openvino"]
    assert section["guard"]["held"] is True  # onnxruntime's top-1 held: OpenVINO's saturation alone refused it


@pytest.mark.no_vnni
def test_on_a_cpu_without_vnni_8_bit_weights_are_named_where_onnxruntime_saturates(digits):
    """On a CPU without VNNI onnxruntime's U8S8 kernels add pairs in 16 bits: an 8-bit file
    that departs from its own arithmetic there is named saturating, never failed; the 7-bit
    default does not depart."""
    passes = InProcessPasses(digits.dataset, BATCH, evaluation=digits.evaluation)
    eight = quantize_export(digits.fp32, int8_options({"reduce_range": False}), passes, digits.verify).section
    entry = eight["runtimes"]["onnxruntime"]
    assert entry["saturates"] is ("onnxruntime" in eight["saturates"])
    assert not entry["saturates"] or "without VNNI" in entry["reason"]
    seven = quantize_export(digits.fp32, int8_options({}), passes, digits.verify).section
    assert seven["runtimes"]["onnxruntime"]["saturates"] is False
    assert seven["runtimes"]["onnxruntime"]["max_abs_diff_to_qdq"] <= eight["runtimes"]["onnxruntime"]["max_abs_diff_to_qdq"]
