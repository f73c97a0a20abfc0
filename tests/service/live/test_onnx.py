"""``bnrecal.export_onnx``: a live model to folded, verified ONNX, the model left as it was."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

import bnrecal
from tests.nets import mixed_net, perturbed
from tests.service.live.helpers import state


def test_a_live_model_exports_folded_and_verified(tmp_path):
    torch.manual_seed(0)
    model = perturbed(mixed_net()).eval()
    sample = torch.randn(4, 3, 6, 6)
    before = state(model)
    section = bnrecal.export_onnx(model, tmp_path / "model.onnx", sample)
    assert section["folded"] >= 2 and section["max_abs_diff"] <= 1e-4
    graph = onnx.load(tmp_path / "model.onnx")
    assert sum(node.op_type == "BatchNormalization" for node in graph.graph.node) == section["batchnorm_nodes"]
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"))
    batch = torch.randn(3, 3, 6, 6)
    (out,) = session.run(None, {session.get_inputs()[0].name: batch.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(out, model(batch).numpy(), atol=1e-4)
    assert all(torch.equal(model.state_dict()[key], value) for key, value in before.items())


def test_a_sample_that_is_not_a_batch_is_refused(tmp_path):
    with pytest.raises(bnrecal.SpecError) as caught:
        bnrecal.export_onnx(mixed_net(), tmp_path / "model.onnx", torch.tensor(1.0))
    assert caught.value.field == "sample" and not (tmp_path / "model.onnx").exists()
