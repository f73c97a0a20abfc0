"""`--openvino` and `--openvino-int8` on calibrate: OpenVINO's own files of the FP32 export
and of the INT8 file, which OpenVINO (in a process of its own, as a deployer would load
them) runs as the ONNX files run; a path that is no `.xml` exits 2 naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from tests.conftest import run_cli, save_array, save_state
from tests.nets import classifier_net, perturbed

pytestmark = pytest.mark.usefixtures("cli_environment")

# OpenVINO runs in a child (never loaded beside torch): the IR and the ONNX file it was made
# from, each on the same samples.
DEPLOYER = """
import sys, numpy as np, openvino as ov
core = ov.Core()
x = np.load(sys.argv[1])
outs = {}
for name, path in zip(("ir", "onnx"), sys.argv[3:5]):
    compiled = core.compile_model(core.read_model(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    outs[name] = np.array(compiled.create_infer_request().infer({0: x})[compiled.outputs[0]])
np.savez(sys.argv[2], **outs)
"""


def in_openvino(tmp_path: Path, samples: np.ndarray, xml: Path, onnx_file: Path) -> dict[str, np.ndarray]:
    np.save(tmp_path / "samples.npy", samples)
    subprocess.run([sys.executable, "-c", DEPLOYER, str(tmp_path / "samples.npy"), str(tmp_path / "ov.npz"),
                    str(xml), str(onnx_file)], check=True, timeout=300)
    with np.load(tmp_path / "ov.npz") as saved:
        return {name: saved[name] for name in saved.files}


def test_calibrate_writes_openvino_ir_that_runs_as_the_onnx_files(tmp_path, capsys):
    torch.manual_seed(3)
    calibration = (torch.randn(24, 3, 8, 8) * 1.5 + 0.3).numpy()
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 6}',
        "--checkpoint", str(save_state(tmp_path / "m.pt", perturbed(classifier_net(6)))),
        "--data", str(save_array(tmp_path / "x.npy", calibration)), "--workers", "1", "--batch-size", "8",
        "--out", str(tmp_path / "out.pt"), "--onnx", str(tmp_path / "m.onnx"), "--onnx-int8", str(tmp_path / "q.onnx"),
        "--openvino", str(tmp_path / "m.xml"), "--openvino-int8", str(tmp_path / "q.xml"),
        "--report", str(tmp_path / "r.json"),
    )
    assert code == 0, err
    assert str(tmp_path / "m.xml") in err and str(tmp_path / "q.xml") in err  # the summary names what it wrote
    report = json.loads((tmp_path / "r.json").read_text())
    for name, made_from in (("openvino", "the verified FP32 ONNX export"), ("openvino_int8", "the checked INT8 ONNX file")):
        section = report[name]
        assert section["made_from"] == made_from and section["verified_batches"] == [1, 8]
        assert section["max_abs_diff_to_onnx_in_openvino"] <= 1e-4 * max(1.0, section["outputs_max_abs"])
    stem = {"openvino": "m", "openvino_int8": "q"}
    for name, part in stem.items():
        xml = (tmp_path / f"{part}.xml").read_text()
        assert xml.lstrip().startswith("<?xml") and "<net " in xml and 'element_type="f16"' not in xml  # weights kept f32
        assert report[name]["bin_bytes"] == (tmp_path / f"{part}.bin").stat().st_size > 0
    assert "FakeQuantize" in (tmp_path / "q.xml").read_text()  # OpenVINO's form of the file's Q/DQ pairs

    # As a deployer loads them: the FP32 IR computes what the FP32 file computes in onnxruntime,
    # the INT8 IR what the INT8 file computes in OpenVINO.
    samples = calibration[:8]
    fp32 = in_openvino(tmp_path, samples, tmp_path / "m.xml", tmp_path / "m.onnx")
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    expected = session.run(None, {session.get_inputs()[0].name: samples})[0]
    scale = max(1.0, float(np.abs(expected).max()))
    assert np.abs(fp32["ir"] - expected).max() <= 1e-4 * scale
    int8 = in_openvino(tmp_path, samples, tmp_path / "q.xml", tmp_path / "q.onnx")
    assert np.abs(int8["ir"] - int8["onnx"]).max() <= 1e-4 * scale
    assert np.abs(int8["ir"] - fp32["ir"]).max() > 0  # the INT8 IR is quantized, not the FP32 model again


@pytest.mark.parametrize("flag", ["--openvino", "--openvino-int8"])
def test_an_ir_path_that_is_no_xml_exits_2_naming_the_flag(tmp_path, capsys, flag):
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:classifier_net",
        "--checkpoint", str(save_state(tmp_path / "m.pt", classifier_net())),
        "--data", str(save_array(tmp_path / "x.npy", np.zeros((4, 3, 8, 8), np.float32))),
        "--out", str(tmp_path / "out.pt"), flag, str(tmp_path / "m.onnx"),
    )
    assert code == 2 and flag in err and ".xml" in err, err
