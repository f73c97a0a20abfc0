"""The quick-start demo's inputs: the promised files, and BN statistics that really are stale.

The staleness is checked against an independent reference, PyTorch's own
``torch.optim.swa_utils.update_bn`` (an exact average with ``momentum=None``), not bnrecal's
engine: recomputing the statistics on the calibration images must raise held-out top-1.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from torch.optim.swa_utils import update_bn

from bnrecal.service import demo

# Held-out top-1 on the new camera, stale -> recomputed with update_bn, measured on seeds 0-2
# of the demo's recipe (the seed stands in for another machine's float rounding):
# 0.458 -> 0.978, 0.400 -> 0.969, 0.211 -> 0.969 (0.978-0.983 on the old scanner).
MIN_GAIN = 0.3
MIN_RECALIBRATED = 0.9


@pytest.fixture
def inputs(demo_inputs: demo.DemoInputs) -> demo.DemoInputs:
    """The demo's files, written once for the session (tests/test_docs.py runs the demo on them too)."""
    return demo_inputs


def top1(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Held-out top-1 in eval mode (BN uses its running statistics)."""
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def load_model(checkpoint: Path) -> torch.nn.Module:
    """Build the model the way the product does for ``torchvision:resnet18`` and load strictly."""
    model = torchvision.models.get_model("resnet18", weights=None, num_classes=10)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    return model


def test_training_says_so_and_shows_each_epoch(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    """A first ``make demo`` trains for minutes on a busy machine: it says so before it starts
    and at each epoch, never silent (one epoch here, to keep the test short)."""
    monkeypatch.setattr(demo, "TRAIN_EPOCHS", 1)
    assert demo.main([str(tmp_path / "demo")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("training the demo's stale resnet18") and "1 epochs" in err[0]
    assert err[1].startswith("  epoch 1/1, ") and err[-1].startswith("trained a resnet18 in")


@pytest.mark.slow
def test_inputs_have_the_promised_shapes(inputs: demo.DemoInputs) -> None:
    assert [path.name for path in inputs] == ["resnet18-stale.pt", "calib.npy", "eval.npz"]
    calib = np.load(inputs.calib)
    assert calib.dtype == np.float32 and calib.shape == (1437, 3, demo.SIZE, demo.SIZE)
    with np.load(inputs.eval) as held_out:
        x, y = held_out["x"], held_out["y"]
    assert x.dtype == np.float32 and x.shape == (demo.HELD_OUT, 3, demo.SIZE, demo.SIZE)
    assert y.dtype == np.int64 and y.shape == (demo.HELD_OUT,) and set(y.tolist()) == set(range(10))
    # Both splits went through the same new camera: half the contrast, a brighter background.
    assert float(calib.std()) < 0.6 and float(calib.mean()) > 0.5
    assert abs(float(x.mean()) - float(calib.mean())) < 0.1 and abs(float(x.std()) - float(calib.std())) < 0.1
    assert torch.load(inputs.checkpoint, weights_only=True)["epochs"] == demo.TRAIN_EPOCHS
    load_model(inputs.checkpoint)


@pytest.mark.slow
def test_recomputing_bn_statistics_restores_held_out_accuracy(inputs: demo.DemoInputs) -> None:
    model = load_model(inputs.checkpoint)
    with np.load(inputs.eval) as held_out:
        x, y = torch.from_numpy(held_out["x"]), torch.from_numpy(held_out["y"])
    stale = top1(model, x, y)
    update_bn(torch.utils.data.DataLoader(torch.from_numpy(np.load(inputs.calib)), batch_size=256), model)
    recalibrated = top1(model, x, y)
    assert recalibrated >= MIN_RECALIBRATED, (stale, recalibrated)
    assert recalibrated - stale >= MIN_GAIN, (stale, recalibrated)


def test_missing_scikit_learn_is_one_clear_line(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # the import now fails
    assert demo.main([str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "install the demo extra: .venv/bin/pip install -e '.[demo]'" in err
    assert not (tmp_path / "demo").exists()


def test_inputs_written_earlier_are_reused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``make demo`` trains the stale model once: a folder that holds all three inputs is
    used as it is (training is most of the demo's time)."""
    folder = tmp_path / "demo"
    folder.mkdir()
    for path in demo.demo_paths(folder):
        path.write_bytes(b"written earlier")
    assert demo.main([str(folder)]) == 0
    out, err = capsys.readouterr()
    assert out.split() == [str(path) for path in demo.demo_paths(folder)]
    assert "reusing the stale model trained earlier" in err and "--retrain" in err
    assert all(path.read_bytes() == b"written earlier" for path in demo.demo_paths(folder))


@pytest.mark.slow
def test_class_ordered_data_with_300_samples_calibrates_as_well_as_all_of_it(
    inputs: demo.DemoInputs, tmp_path: Path, warm_pool: Any
) -> None:
    """The calibration scans written class by class (as class folders are read): 300 samples
    of the default fair order do as well as all 1437 (within noise), and the report says the
    order was seeded; the first 300 of the file (three classes) do measurably worse."""
    from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate
    from bnrecal.service.settings import Settings

    labels = demo.load_digits_split(0).train_y.numpy()
    by_class = tmp_path / "calib-by-class.npy"
    np.save(by_class, np.load(inputs.calib)[np.argsort(labels, kind="stable")])
    settings = Settings(data_dir=tmp_path / "data")

    def evaluated(**options: object) -> dict:
        request = RecalibrationRequest(
            arch="torchvision:resnet18", model_kwargs={"num_classes": 10}, checkpoint=inputs.checkpoint,
            data=by_class, eval_data=inputs.eval, batch_size=32, **options,
        )
        return recalibrate(request, settings, pool=warm_pool).report  # the three runs on one gang

    everything, fair, first = evaluated(), evaluated(max_samples=300), evaluated(max_samples=300, order="given")
    assert (fair["order"], fair["seed"], fair["samples"]) == ("shuffled", 0, 300)
    after = {name: report["evaluation"]["after"] for name, report in
             (("all", everything), ("fair", fair), ("first", first))}
    # Within noise: over 5 seeds 300 fair samples give 0.970 +- 0.006 and 0.106 +- 0.012 against
    # 0.975 and 0.091 for all (docs/calibration.md); the file's first 300 give 0.658 and 7.2.
    # The demo model is trained here, so its figures follow the machine's kernels: on another
    # machine of this kind the first 300 gave 0.903 and 1.40 against the fair 300's 0.972: worse
    # by 7 points, and many times in cross-entropy.
    assert after["fair"]["top1"] >= after["all"]["top1"] - 0.02, after
    assert after["fair"]["cross_entropy"] <= after["all"]["cross_entropy"] + 0.05, after
    assert after["first"]["top1"] <= after["fair"]["top1"] - 0.05, after
    assert after["first"]["cross_entropy"] >= after["fair"]["cross_entropy"] + 0.5, after
