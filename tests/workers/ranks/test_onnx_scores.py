"""Exported models scored on real Ray ranks (``workers.ranks.onnx_scores``): the same
top-1/top-5 for K = 1, 2, 4 (a rank with an empty shard at the last step), equal to the
model's own PyTorch answers counted here (an independent reference), on all samples and on
the INT8 guard's two parts (even and odd positions); one collective per pass, however many
models it scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision

from bnrecal.workers.data import iter_batches
from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.workers.ranks.group import GroupOptions
from bnrecal.workers.ranks.onnx_scores import ScoreRequest, score_pass
from bnrecal.workers.ranks.range_group import run_range_group
from bnrecal.workers.ranks.sharding import rank_ranges

from bnrecal.service.export.int8.checks import HeldScorer, LabelledBatches
from tests.service.export.int8_helpers import array_dataset, fp32_export

SAMPLES, BATCH, CLASSES = 41, 16, 10


def torch_counts(model: torch.nn.Module, samples: torch.Tensor, labels: np.ndarray, keep: np.ndarray) -> tuple[int, int]:
    """Top-1 and top-5 right answers of the PyTorch model itself on the kept samples."""
    with torch.no_grad():
        logits = model.eval()(samples[torch.from_numpy(keep)])
    top5 = logits.topk(5, dim=1).indices.numpy()
    kept = labels[keep]
    return int((top5[:, 0] == kept).sum()), int((top5 == kept[:, None]).any(axis=1).sum())


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scores")
    torch.manual_seed(0)
    first, second = torchvision.models.resnet18(num_classes=CLASSES), torchvision.models.resnet18(num_classes=CLASSES)
    samples = torch.randn(SAMPLES, 3, 24, 24)
    models = [fp32_export(first, samples, tmp / "a.onnx"), fp32_export(second, samples, tmp / "b.onnx")]
    with torch.no_grad():  # labels the first model gets right about half the time: the counts are not trivial
        guesses = first.eval()(samples).argmax(1).numpy()
    labels = np.where(np.arange(SAMPLES) % 2 == 0, guesses, (guesses + 1) % CLASSES).astype(np.int64)
    return first, second, samples, models, labels, array_dataset(tmp / "x.npy", samples)


@pytest.mark.parametrize("part", ["all", "even", "odd"])
def test_scores_match_the_models_own_answers_for_any_number_of_ranks(scored, warm_pool, part):
    first, second, samples, models, labels, dataset = scored
    positions = np.arange(SAMPLES)
    keep = np.ones(SAMPLES, bool) if part == "all" else positions % 2 == (0 if part == "even" else 1)
    expected = [torch_counts(net, samples, labels, keep) for net in (first, second)]
    request = ScoreRequest(labels, part)
    ranges = rank_ranges(SAMPLES, BATCH, 1, 0)
    with dataset.open() as data:
        here = score_pass(models, request, ranges, iter_batches(data, ranges), SingleProcessCollective())
    assert (here.top1, here.top5) == ([e[0] for e in expected], [e[1] for e in expected])
    assert here.scored == int(keep.sum()) and here.collectives == 1
    for world in (1, 2, 4):
        group = run_range_group(models, request, dataset, BATCH, world, "cpu", "gloo", GroupOptions(cpus_per_worker=1),
                                pool=warm_pool)
        result = group.result
        assert (result.top1, result.top5, result.scored) == (here.top1, here.top5, here.scored), world
        assert group.collectives == [1] * world and sum(group.samples) == SAMPLES


def test_held_batches_score_the_same_parts(scored):
    """The Python API scores evaluation batches it holds: the same figures on each part."""
    _, _, samples, models, labels, dataset = scored
    held = HeldScorer(LabelledBatches([samples[i : i + 7].numpy() for i in range(0, SAMPLES, 7)],
                                      [labels[i : i + 7] for i in range(0, SAMPLES, 7)]))
    ranges = rank_ranges(SAMPLES, BATCH, 1, 0)
    for part in ("all", "even", "odd"):
        with dataset.open() as data:
            result = score_pass(models, ScoreRequest(labels, part), ranges, iter_batches(data, ranges),
                                SingleProcessCollective())
        assert held(models, part) == [result.scores(0), result.scores(1)], part
