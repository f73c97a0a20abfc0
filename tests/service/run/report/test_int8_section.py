"""The HTML report's INT8 section: accuracy of FP32 and INT8, stale and recalibrated side by
side, and every op left in float with its reason (escaped, offline)."""

from __future__ import annotations

from bnrecal.service.run.report.page import render_html_report
from tests.service.run.report.test_page import assert_offline, typed

RANGES = {  # what every int8 section says of its range pass
    "target": "onnxruntime", "symmetric_activations": False, "per_channel": True, "reduce_range": False,
    "format": "QDQ", "writer": "onnxruntime", "tensors_calibrated": 30, "range_seconds": 1.0,
}


def test_int8_section_shows_accuracy_side_by_side_and_ops_left_float():
    report = {
        "arch": "torchvision:resnet18", "mode": "sync", "world_size": 2, "samples": 64, "steps": 1, "seconds": 0.5,
        "layers": [], "nodes": ["n1"],
        "int8": {
            **RANGES, "method": "minmax", "weight_type": "int8", "weights": "symmetric, per output channel",
            "activation_type": "uint8", "samples": 64, "world_size": 2, "collectives": [1, 1],
            "ops_quantized": {"Conv": 20, "Gemm": 1}, "bytes": 11 * 2**20, "fp32_bytes": 44 * 2**20,
            "max_abs_diff": 0.25, "fp32_max_abs": 20.0,
            "ops_float": [{"name": "head<fc>", "op_type": "Gemm", "reason": "kept float as asked (int8.keep_float)"}],
            "evaluation": {"samples": 360, "fp32": {"top1": 0.975, "top5": 1.0}, "int8": {"top1": 0.972, "top5": 1.0},
                           "stale_fp32": {"top1": 0.35, "top5": 0.81}, "stale_int8": {"top1": 0.34, "top5": 0.80},
                           "top1_drop_points": 0.3},
        },
    }
    page = render_html_report(typed(report))
    assert 'id="int8"' in page and "Conv 20, Gemm 1" in page
    for label in ("FP32, stale statistics", "FP32, recalibrated", "INT8, stale statistics", "INT8, recalibrated"):
        assert label in page
    assert "0.972" in page and "0.34" in page
    assert "head&lt;fc&gt;" in page and "int8.keep_float" in page
    assert_offline(page)


def test_int8_section_shows_target_runtimes_guard_and_why_no_file():
    report = {
        "arch": "torchvision:resnet18", "mode": "sync", "world_size": 1, "samples": 64, "steps": 1, "seconds": 0.5,
        "layers": [], "nodes": ["n1"],
        "int8": {
            **RANGES, "target": "tensorrt", "method": "minmax", "weight_type": "int8", "weights": "symmetric, per output channel",
            "activation_type": "int8", "samples": 64, "world_size": 1, "collectives": [1], "written": False,
            "failure": "INT8 top-1 stays 3.00 points below FP32 ... no INT8 file written",
            "guard": {"max_top1_drop": 0.5, "held": False, "kept_float": [],
                      "selection": {"samples": 180, "which": "evaluation samples at even positions (0, 2, 4, ...)",
                                    "fp32_top1": 0.95, "int8_top1_before": 0.92},
                      "report": {"samples": 180, "which": "evaluation samples at odd positions (1, 3, 5, ...)"}},
            "evaluation": {"samples": 180, "fp32": {"top1": 0.95, "top5": 1.0}, "int8": {"top1": 0.92, "top5": 1.0},
                           "top1_drop_points": 3.0},
        },
    }
    page = render_html_report(typed(report))
    assert "No INT8 file: INT8 top-1 stays 3.00 points" in page and "tensorrt" in page
    assert "float ops chosen on 180 evaluation samples at even positions" in page
    assert_offline(page)


def test_int8_section_says_the_weights_bits_the_cpu_and_a_runtime_that_saturates():
    saturating = ("the INT8 model's outputs in OpenVINO depart from its own Q/DQ arithmetic by 3.6 (allowed 1.36, 5% "
                  "of the outputs' scale): its 8-bit kernels saturate on this CPU without VNNI")
    report = {
        "arch": "torchvision:resnet18", "mode": "sync", "world_size": 1, "samples": 64, "steps": 1, "seconds": 0.5,
        "layers": [], "nodes": ["n1"],
        "int8": {
            **RANGES, "method": "minmax", "weight_type": "int8", "weights": "symmetric, per output channel, 8-bit",
            "weights_why": "8-bit weights, as asked (int8.reduce_range false): for CPUs with VNNI",
            "activation_type": "uint8", "samples": 64, "world_size": 1, "collectives": [1],
            "ops_quantized": {"Conv": 20}, "bytes": 11 * 2**20, "fp32_bytes": 44 * 2**20,
            "max_abs_diff": 0.23, "fp32_max_abs": 27.3, "qdq_max_abs_diff": 0.23,
            "runtimes": {"reference": "the FP32 export in onnxruntime, on the verified batches",
                         "onnxruntime": {"ran": True, "version": "1.32.0", "max_abs_diff": 0.23,
                                         "max_abs_diff_to_qdq": 0.0, "saturates": False},
                         "openvino": {"ran": True, "version": "2026.4.1", "max_abs_diff": 3.37,
                                      "max_abs_diff_to_qdq": 3.6, "saturates": True, "reason": saturating}},
            "cpu": {"model": "AMD EPYC 7B12", "flags": ["sse4_2", "avx2"], "vnni": False},
            "saturates": ["openvino"],
        },
    }
    page = render_html_report(typed(report))
    assert "8-bit weights, as asked (int8.reduce_range false)" in page
    assert "SATURATES</strong>: the INT8 model&#39;s outputs in OpenVINO depart" in page
    assert "vs its own Q/DQ arithmetic 0" in page
    assert "AMD EPYC 7B12 (sse4_2, avx2, no VNNI)" in page
    assert_offline(page)
