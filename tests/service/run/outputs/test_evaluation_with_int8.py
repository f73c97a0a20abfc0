"""With an INT8 file the evaluation before and after is measured by the INT8 export's passes,
on the folded FP32 models (docs/evaluation.md, "How"): the same figures as the PyTorch
evaluation beside the statistics, on labelled data of its own and on unlabelled data that is
the calibration data (then one pass gathers the ranges and compares the models)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.run.outputs.later_phases import RunOutputs
from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import save_array, save_state
from tests.nets import classifier_net, perturbed

CLASSES = 12


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.manual_seed(6)
    folder = tmp_path_factory.mktemp("eval-int8")
    calibration = torch.randn(40, 3, 8, 8) * 2 + 1
    evaluation = torch.randn(27, 3, 8, 8) * 2 + 1
    np.savez(folder / "eval.npz", x=evaluation.numpy(), y=np.random.default_rng(1).integers(0, CLASSES, 27))
    return {
        "checkpoint": save_state(folder / "model.pt", perturbed(classifier_net(CLASSES))),
        "data": save_array(folder / "calib.npy", calibration),
        "eval": folder / "eval.npz",
    }


def evaluated(inputs, settings, tmp_path, eval_data: Path, int8: bool):
    request = RecalibrationRequest(arch="tests.nets:classifier_net", model_kwargs={"classes": CLASSES},
                                   checkpoint=inputs["checkpoint"], data=inputs["data"], eval_data=eval_data,
                                   workers=1, batch_size=8)
    outputs = RunOutputs(int8=tmp_path / "m8.onnx", int8_options=Int8Options()) if int8 else None
    return recalibrate(request, settings, in_process=True, outputs=outputs).report


def test_labelled_figures_are_those_of_the_pytorch_evaluation(inputs, settings, tmp_path):
    plain = evaluated(inputs, settings, tmp_path, inputs["eval"], int8=False)
    with_int8 = evaluated(inputs, settings, tmp_path, inputs["eval"], int8=True)
    ours, theirs = with_int8["evaluation"], plain["evaluation"]
    assert (ours["runtime"], theirs["runtime"]) == ("onnxruntime", "pytorch")
    assert ours["samples"] == theirs["samples"] == 27 and ours["labelled"]
    for side in ("before", "after"):
        assert ours[side]["top1"] == theirs[side]["top1"] and ours[side]["top5"] == theirs[side]["top5"]
        assert ours[side]["cross_entropy"] == pytest.approx(theirs[side]["cross_entropy"], rel=1e-4)
    assert ours["prediction_change"] == theirs["prediction_change"]
    assert ours["kl_divergence"] == pytest.approx(theirs["kl_divergence"], rel=1e-3, abs=1e-7)
    # the INT8 section's FP32 figures are the evaluation's "after" and the stale one its "before"
    assert with_int8["int8"]["evaluation"]["fp32"]["top1"] == ours["after"]["top1"]
    assert with_int8["int8"]["evaluation"]["stale_fp32"]["top1"] == ours["before"]["top1"]
    phases = {entry["phase"] for entry in with_int8["timeline"]}
    assert {"INT8 ranges", "evaluation before and after", "INT8 evaluations"} <= phases


def test_unlabelled_calibration_data_is_compared_in_the_range_pass(inputs, settings, tmp_path):
    """The calibration array given again as (unlabelled) evaluation data: the models are
    compared in the pass that gathers the ranges; nothing is scored."""
    plain = evaluated(inputs, settings, tmp_path, inputs["data"], int8=False)
    with_int8 = evaluated(inputs, settings, tmp_path, inputs["data"], int8=True)
    ours, theirs = with_int8["evaluation"], plain["evaluation"]
    assert not ours["labelled"] and ours["samples"] == theirs["samples"] == 40
    assert ours["prediction_change"] == theirs["prediction_change"]
    assert ours["kl_divergence"] == pytest.approx(theirs["kl_divergence"], rel=1e-3, abs=1e-7)
    timeline = {entry["phase"]: entry for entry in with_int8["timeline"]}
    assert timeline["INT8 ranges and evaluation before and after"]["passes"] == 1
    assert "INT8 evaluations" not in timeline and "evaluation" not in with_int8["int8"]
