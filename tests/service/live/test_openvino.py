"""``bnrecal.export_openvino`` and ``bnrecal.quantize(..., openvino=)``: a live model as
OpenVINO's own files, which OpenVINO (in a process of its own, as a deployer loads them)
runs as the model and the INT8 file run; the model left as it was; a path that is no
``.xml`` refused before any work."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import bnrecal
from tests.nets import classifier_net, perturbed
from tests.service.cli.test_cli_openvino import in_openvino
from tests.service.live.helpers import state


def test_a_live_model_and_its_int8_file_as_openvino_ir(tmp_path):
    torch.manual_seed(4)
    model = perturbed(classifier_net(6)).eval()
    calibration = torch.randn(24, 3, 8, 8) * 1.5 + 0.3
    before = state(model)
    section = bnrecal.export_openvino(model, tmp_path / "m.xml", calibration[:8])
    assert isinstance(section, bnrecal.OpenVinoSection)
    assert section.made_from == "the verified FP32 ONNX export" and section.verified_batches == [1, 8]
    assert (tmp_path / "m.bin").stat().st_size == section.bin_bytes
    samples = torch.randn(5, 3, 8, 8).numpy()
    with torch.no_grad():
        expected = model(torch.from_numpy(samples)).numpy()
    bnrecal.export_onnx(model, tmp_path / "m.onnx", calibration[:8])
    ran = in_openvino(tmp_path, samples, tmp_path / "m.xml", tmp_path / "m.onnx")
    np.testing.assert_allclose(ran["ir"], expected, atol=1e-4 * max(1.0, float(np.abs(expected).max())))

    bnrecal.quantize(model, tmp_path / "q.onnx", calibration, openvino=tmp_path / "q.xml")
    session = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    (int8,) = session.run(None, {session.get_inputs()[0].name: samples})
    ran = in_openvino(tmp_path, samples, tmp_path / "q.xml", tmp_path / "q.onnx")
    np.testing.assert_allclose(ran["ir"], ran["onnx"], atol=1e-4 * max(1.0, float(np.abs(int8).max())))
    assert (ran["ir"].argmax(1) == int8.argmax(1)).mean() >= 0.8  # the INT8 arithmetic judged by its own checks
    assert all(torch.equal(model.state_dict()[key], value) for key, value in before.items())


def test_a_path_that_is_not_an_xml_is_refused_before_any_work(tmp_path):
    with pytest.raises(bnrecal.SpecError, match=r"\.xml") as caught:
        bnrecal.export_openvino(classifier_net(6), tmp_path / "m.onnx", torch.randn(2, 3, 8, 8))
    assert caught.value.field == "path" and not list(tmp_path.iterdir())
    with pytest.raises(bnrecal.SpecError) as caught:
        bnrecal.quantize(classifier_net(6), tmp_path / "q.onnx", torch.randn(8, 3, 8, 8), openvino=tmp_path / "q.bin")
    assert caught.value.field == "openvino" and not list(tmp_path.iterdir())
