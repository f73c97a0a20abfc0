"""``bnrecal.quantize``: a live model to a checked INT8 file, the model left as it was."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch

import bnrecal
from tests.nets import classifier_net, perturbed


def test_quantize_writes_a_checked_int8_file_and_leaves_the_model_alone(tmp_path):
    torch.manual_seed(2)
    model = perturbed(classifier_net(5)).train()
    before = copy.deepcopy(model.state_dict())
    data = torch.randn(40, 3, 8, 8)
    inputs, labels = torch.randn(20, 3, 8, 8), torch.arange(20) % 5
    section = bnrecal.quantize(model, tmp_path / "m-int8.onnx", data, options={"method": "percentile"},
                               eval_data=(inputs, labels), batch_size=16)
    onnx.checker.check_model(onnx.load(tmp_path / "m-int8.onnx"), full_check=True)
    assert section["method"] == "percentile" and section["samples"] == 40 and section["collectives"] == [2]
    assert section.evaluation is not None and set(section["evaluation"].to_dict()) >= {"fp32", "int8"}
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_quantize_refuses_bad_options_naming_them(tmp_path):
    with pytest.raises(bnrecal.SpecError) as caught:
        bnrecal.quantize(classifier_net(5), tmp_path / "q.onnx", torch.randn(4, 3, 8, 8), options={"method": "kl"})
    assert caught.value.field == "options.method"
    assert not (tmp_path / "q.onnx").exists()
