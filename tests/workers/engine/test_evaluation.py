"""Evaluation metrics in one process, against plain formulas computed here, and its labels."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bnrecal.workers.data import ReadOptions, describe_dataset, read_labels
from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.workers.engine.evaluation import check_eval_output, evaluation_pass, model_logits, with_statistics
from bnrecal.workers.engine.moments import MomentStats
from bnrecal.errors import DatasetError, EvaluationError

from tests.nets import classifier_net, feature_list_net, perturbed, segmenter_net
from tests.reference import assert_metrics_match, reference_metrics


def new_statistics(model: torch.nn.Module, scale: float) -> list[MomentStats]:
    bn = model.bn
    return [MomentStats(100, bn.running_mean + scale, bn.running_var * (1 + scale))]


def batches_of(x: torch.Tensor, y: np.ndarray | None, size: int) -> tuple[list[torch.Tensor], list[np.ndarray | None]]:
    starts = range(0, x.shape[0], size)
    return [x[s : s + size] for s in starts], [y[s : s + size] if y is not None else None for s in starts]


def test_labelled_metrics_match_their_definitions() -> None:
    torch.manual_seed(0)
    before = perturbed(classifier_net(12)).eval()
    after = with_statistics(before, ["bn"], new_statistics(before, 0.5), steps=3)
    x = torch.randn(37, 3, 8, 8)
    y = np.random.default_rng(0).integers(0, 12, 37)
    target = check_eval_output(before, x[:1], y)
    assert target.labelled and target.classes == 12
    batches, labels = batches_of(x, y, 10)
    metrics, _ = evaluation_pass(before, after, batches, labels, target, collective=SingleProcessCollective())
    with torch.no_grad():
        expected = reference_metrics(before(x), after(x), torch.from_numpy(y))
    assert metrics.samples == 37 and metrics.labelled
    assert_metrics_match(metrics, expected, cross_entropy_rel=1e-6, kl_rel=1e-5)
    assert metrics.kl_divergence > 0 and metrics.before != metrics.after
    assert after.bn.num_batches_tracked.item() == before.bn.num_batches_tracked.item() + 3


def test_identical_statistics_change_nothing() -> None:
    torch.manual_seed(1)
    model = perturbed(classifier_net(4)).eval()
    stats = [MomentStats(10, model.bn.running_mean, model.bn.running_var * 0.9)]  # unbiased: x 10/9
    same = with_statistics(model, ["bn"], stats, 1)
    x = torch.randn(9, 3, 8, 8)
    y = np.arange(9) % 4
    target = check_eval_output(model, x[:1], y)
    metrics, _ = evaluation_pass(model, same, [x], [y], target, collective=SingleProcessCollective())
    assert metrics.prediction_change == 0 and metrics.kl_divergence == pytest.approx(0, abs=1e-9)
    assert metrics.before.top1 == metrics.after.top1
    assert metrics.before.cross_entropy == pytest.approx(metrics.after.cross_entropy, rel=1e-7)
    assert metrics.before.top5 is None  # 4 classes: no top-5


def test_segmentation_output_is_compared_per_position_and_labels_are_not_used() -> None:
    torch.manual_seed(2)
    before = perturbed(segmenter_net(5)).eval()
    after = with_statistics(before, ["bn"], new_statistics(before, 1.0), steps=1)
    x = torch.randn(6, 3, 7, 7)
    target = check_eval_output(before, x[:1], np.zeros(6, dtype=np.int64))
    assert not target.labelled and target.output_shape == (5, 7, 7) and "labels not used" in (target.note or "")
    metrics, _ = evaluation_pass(before, after, [x[:4], x[4:]], [None, None], target,
                                 collective=SingleProcessCollective())
    with torch.no_grad():
        flat = [m(x)["out"].movedim(1, -1).reshape(-1, 5) for m in (before, after)]
    expected = reference_metrics(*flat, None)
    assert metrics.prediction_change == pytest.approx(expected["changed"], abs=1e-12)
    assert metrics.kl_divergence == pytest.approx(expected["kl"], rel=1e-5)
    assert metrics.before is None and metrics.note == target.note


def test_unusable_outputs_and_labels_fail_with_a_clear_message() -> None:
    sample = torch.randn(1, 3, 8, 8)
    with pytest.raises(EvaluationError, match="mapping with keys \\['shape'\\]"):
        check_eval_output(feature_list_net(), sample, None)
    with pytest.raises(EvaluationError, match="labels go up to 12 but the model outputs 12 classes"):
        check_eval_output(classifier_net(12), sample, np.array([0, 12]))
    with pytest.raises(EvaluationError, match="cannot run on the evaluation data \\(sample shape \\(1, 8, 8\\)\\)"):
        check_eval_output(classifier_net(12), torch.randn(1, 1, 8, 8), None)
    with pytest.raises(EvaluationError, match="class axis"):
        check_eval_output(torch.nn.Flatten(0), sample, None)
    assert model_logits((torch.ones(2, 3), torch.zeros(2, 3))).sum() == 6  # the main head of (logits, aux)


def test_labels_come_from_npz_y_and_class_folders(tmp_path: Path) -> None:
    x = np.zeros((5, 3, 4, 4), np.float32)
    np.savez(tmp_path / "eval.npz", x=x, y=np.array([3, 1, 4, 1, 5]))
    spec = describe_dataset(tmp_path / "eval.npz", ReadOptions(max_samples=4))
    assert read_labels(spec).tolist() == [3, 1, 4, 1]
    np.save(tmp_path / "plain.npy", x)
    assert read_labels(describe_dataset(tmp_path / "plain.npy")) is None
    np.savez(tmp_path / "short.npz", x=x, y=np.array([1, 2]))
    with pytest.raises(DatasetError, match="expected one per sample, shape \\(5,\\)"):
        read_labels(describe_dataset(tmp_path / "short.npz"))
    np.savez(tmp_path / "float.npz", x=x, y=np.zeros(5))
    with pytest.raises(DatasetError, match="must be integer class indices"):
        read_labels(describe_dataset(tmp_path / "float.npz"))
    for label, name in ((0, "cat"), (1, "dog"), (1, "dog2")):
        folder = tmp_path / "images" / ("cat" if label == 0 else "dog")
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(folder / f"{name}.png")
    images = describe_dataset(tmp_path / "images", ReadOptions(transform={"resize": 8, "crop": 8}))
    assert read_labels(images).tolist() == [0, 1, 1]


def test_evaluation_data_errors_say_evaluation(tmp_path: Path) -> None:
    (tmp_path / "notes.bin").write_text("hello")
    with pytest.raises(DatasetError, match="unknown evaluation data format 'notes.bin'"):
        describe_dataset(tmp_path / "notes.bin", ReadOptions(role="evaluation data"))
    (tmp_path / "notes.txt").write_text("hello")  # a .txt is read as a manifest of shards
    with pytest.raises(DatasetError, match="^evaluation data: manifest notes.txt, line 1: 'hello' is not a"):
        describe_dataset(tmp_path / "notes.txt", ReadOptions(role="evaluation data"))
    with pytest.raises(DatasetError, match="evaluation data not found"):
        describe_dataset(tmp_path / "missing.npz", ReadOptions(role="evaluation data"))


def test_cross_entropy_of_a_confident_model_is_finite() -> None:
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3, 10))
    with torch.no_grad():
        model[1].weight.fill_(0)
        model[1].bias.copy_(torch.arange(10.0) * 200)  # softmax underflows to 0 outside class 9
    target = check_eval_output(model, torch.zeros(1, 3), np.array([0]))
    metrics, _ = evaluation_pass(model, model, [torch.zeros(2, 3)], [np.array([0, 9])], target,
                                 collective=SingleProcessCollective())
    assert math.isfinite(metrics.before.cross_entropy) and metrics.before.top1 == 0.5
    assert metrics.before.cross_entropy == pytest.approx(1800 / 2)
