"""Issue 30's five reproductions, as a user meets them: ``bnrecal.recalibrate`` in the
calling process (one worker, no Ray) and on two Ray ranks changes nothing of the caller's
model but its BN statistics, takes every batch ``update_bn`` takes (shapes that vary,
detection-style lists of images), refuses before any work a batch it cannot split, and
calibrates a Hugging Face model without ``forward=``. Statistics are checked against an
independent reference that runs the model's own code (``guest.hooked_reference``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import bnrecal
from bnrecal.workers.ranks.gangs.warm_context import warm_ranks
from tests.service.live.guest import assert_statistics, assert_untouched, hooked_reference, snapshot

pytestmark = pytest.mark.usefixtures("ray_cluster")

WHERE = ["here", "ray"]


def run(model, data, where, pool, **options):
    """One worker in this process, or two Ray ranks (warm actors of the module's pool)."""
    ranks = {"workers": 2} if where == "ray" else {}
    with warm_ranks(pool) if where == "ray" else contextlib.nullcontext():
        return bnrecal.recalibrate(model, data, progress=False, **ranks, **options)


def call(model, batch):
    return model(batch)


class CachingHead(nn.Module):
    """A head that caches a grid in attributes shadowing class attributes (ultralytics' Detect)."""

    shape = None
    grid = torch.empty(0)

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        y = self.conv(y)
        if self.shape != y.shape:
            self.grid, self.shape = torch.arange(y.shape[-1], dtype=y.dtype), y.shape
        return y + self.grid


class CachingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = CachingHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)))


@pytest.mark.parametrize("where", WHERE)
def test_a_head_that_caches_a_grid_is_left_as_it_was(where, warm_pool):
    torch.manual_seed(0)
    model, x = CachingNet(), torch.randn(16, 3, 8, 8) * 2 + 1
    expected = hooked_reference(model, [x[:8], x[8:]], call)
    before = snapshot(model)
    report = run(model, x, where, warm_pool, batch_size=8)
    assert type(model.head.grid) is torch.Tensor and "grid" not in vars(model.head)
    assert_statistics(model, expected)
    assert_untouched(before, model, lambda m: m(x[:2]))
    assert report["samples"] == 16 and report["world_size"] == (2 if where == "ray" else 1)


@pytest.mark.parametrize("where", WHERE)
def test_submodule_modes_stay_the_callers(where, warm_pool):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5))
    model.train()
    model[2].eval()
    x = torch.randn(16, 3, 8, 8)
    expected = hooked_reference(model, [x[:8], x[8:]], call)
    before = snapshot(model)
    run(model, x, where, warm_pool, batch_size=8)
    assert model.training and model[1].training and not model[2].training
    assert_statistics(model, expected)
    assert_untouched(before, model, lambda m: m(x[:2]))


@pytest.mark.parametrize("where", WHERE)
def test_batches_whose_shape_varies_between_steps(where, warm_pool):
    torch.manual_seed(2)
    model = nn.BatchNorm1d(2)
    batches = [torch.randn(2, 2, 10) * 3 + 1, torch.randn(2, 2, 100) - 2]
    expected = hooked_reference(model, batches, call)
    report = run(model, batches, where, warm_pool)
    assert_statistics(model, expected)
    assert report["samples"] == 4 and report["steps"] == 2
    assert int(model.num_batches_tracked) == 2


class TinyDetector(nn.Module):
    """A detector's interface: a list of CHW images in, a list of dicts out (eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.bn = nn.BatchNorm2d(5)
        self.score = nn.Conv2d(5, 1, 1)

    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        scores = self.score(torch.relu(self.bn(self.conv(torch.stack(images))))).amax((1, 2, 3))
        return [{"scores": s[None]} for s in scores]


@pytest.mark.parametrize("where", WHERE)
def test_detection_style_batches_are_split_by_sample(where, warm_pool):
    torch.manual_seed(3)
    model = TinyDetector().eval()
    steps = [
        ([torch.randn(3, 16, 16) * 2 + 0.5 for _ in range(8)],
         [{"boxes": torch.rand(2, 4), "labels": torch.tensor([1, 2])} for _ in range(8)])
        for _ in range(2)
    ]
    expected = hooked_reference(model, steps, lambda m, batch: m(batch[0]))
    before = snapshot(model)
    report = run(model, steps, where, warm_pool)
    assert report["samples"] == 16 and report["steps"] == 2
    assert_statistics(model, expected)
    assert_untouched(before, model, lambda m: m(steps[0][0][:2]))


def test_a_batch_that_cannot_be_split_is_refused_before_any_work(warm_pool):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    batches = [(torch.randn(8, 3, 6, 6), torch.randn(3))]  # 8 samples beside a tensor of 3
    before = snapshot(model)
    with pytest.raises(bnrecal.DatasetError, match="cannot tell its samples apart.*DataLoader over a map-style"):
        run(model, batches, "ray", warm_pool)
    assert torch.equal(model[1].running_var, torch.ones(4))  # nothing ran
    assert_untouched(before, model, lambda m: m(batches[0][0]))
    report = run(model, batches, "here", warm_pool)  # one worker splits nothing: taken as update_bn takes it
    assert report["samples"] == 8


@pytest.mark.parametrize("where", WHERE)
def test_a_hugging_face_model_calibrates_without_forward(where, warm_pool):
    pytest.importorskip("transformers")
    from tests.hf import tiny_model

    model = tiny_model("ResNetForImageClassification")
    x = torch.randn(12, 3, 32, 32) * 1.5 + 0.2
    expected = hooked_reference(model, [x[:6], x[6:]], call)
    before = snapshot(model)
    report = run(model, x, where, warm_pool, batch_size=6)
    assert_statistics(model, expected)
    assert_untouched(before, model, lambda m: m(x[:2]))
    assert report["model"]["transport"] == ("program" if where == "ray" else "in-process")


def test_a_float64_model_is_told_to_pass_forward():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).double()
    with pytest.raises(bnrecal.SpecError, match=r"computes in float64.*forward=lambda model, batch"):
        bnrecal.recalibrate(model, torch.randn(8, 3, 6, 6), batch_size=4, progress=False)
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64)
    expected = hooked_reference(model, [x[:4], x[4:]], call)
    bnrecal.recalibrate(model, x, batch_size=4, progress=False, forward=lambda m, batch: m(batch[0].double()))
    assert_statistics(model, expected)
