"""``bnrecal.recalibrate`` on the real local Ray cluster: a live model recalibrated in
place from a DataLoader, a Dataset or an iterable of batches, to the same statistics as
the CLI's engine and the independent float64 reference; every other tensor unchanged."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from bnrecal.service.run.recalibrate import RecalibrationRequest
from bnrecal.service.run.recalibrate import recalibrate as recalibrate_files

import bnrecal
from bnrecal.workers.ranks.gangs.warm_context import warm_ranks
from tests.conftest import save_array, save_state
from tests.nets import mixed_net, perturbed
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics
from tests.service.live.helpers import assert_only_bn_buffers_changed, state

pytestmark = pytest.mark.usefixtures("ray_cluster")


class OwnNet(nn.Module):
    """A model whose class exists only in this test module, taking two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(6 + 2, 4)
        self.bn_fc = nn.BatchNorm1d(4)

    def forward(self, image: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        pooled = self.drop(torch.relu(self.bn(self.conv(image)))).mean((2, 3))
        return self.bn_fc(self.fc(torch.cat([pooled, extra], 1)))


class TwoInputs(nn.Module):
    """OwnNet as the reference runs it: both inputs packed in one tensor."""

    def __init__(self, net: OwnNet) -> None:
        super().__init__()
        self.net = net

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        image = packed[:, : 3 * 36].reshape(-1, 3, 6, 6)
        return self.net(image, packed[:, 3 * 36:])


class Records(Dataset):
    """A map-style dataset of dict samples (an image and side features), as real pipelines have."""

    def __init__(self, images: torch.Tensor, extra: torch.Tensor) -> None:
        self.images, self.extra = images, extra

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor | int]:
        return {"image": self.images[index], "extra": self.extra[index], "id": index}


class Pairs(Dataset):
    """A map-style dataset of (input, label) samples."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.x[index], index % 3


def feed_record(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["image"], batch["extra"])


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, torch.Tensor, Path, Path]:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("live")
    model = perturbed(mixed_net()).eval()
    samples = torch.randn(24, 3, 6, 6) * 1.4 + 0.3
    return model, samples, save_state(folder / "mixed.pt", model), save_array(folder / "x.npy", samples)


@pytest.mark.parametrize(("workers", "mode", "where"), [
    (1, "sync", "here"), (1, "sync", "ray"), (2, "sync", "ray"), (1, "local", "here"), (1, "local", "ray"),
    (2, "local", "ray"),
])
def test_a_dataloader_gives_the_clis_and_the_references_statistics(mixed, settings, warm_pool, workers, mode, where):
    model, samples, checkpoint, data = mixed
    live = copy.deepcopy(model)
    before = state(live)
    with warm_ranks(warm_pool) if where == "ray" else contextlib.nullcontext():  # else in this process, without Ray
        report = bnrecal.recalibrate(
            live, DataLoader(TensorDataset(samples), batch_size=6), workers=workers, mode=mode, progress=False,
        )
    assert report["backend"] == ("in-process" if where == "here" else "gloo")
    assert_matches_reference(live, reference_statistics(model, samples, 6, world_size=workers, mode=mode))
    assert_only_bn_buffers_changed(before, live, steps=4)
    cli = recalibrate_files(
        RecalibrationRequest(arch="tests.nets:mixed_net", checkpoint=checkpoint, data=data, workers=workers,
                             batch_size=6, mode=mode, order="given"),  # the DataLoader's own order
        settings, pool=warm_pool,  # the engine's ranks, warm from the module's earlier runs of this shape
    )
    ours = live.state_dict()
    for key, value in cli.updates.items():
        torch.testing.assert_close(ours[key].double(), value.double(), rtol=1e-5, atol=1e-7)
    assert report["world_size"] == workers and report["mode"] == mode and report["samples"] == 24
    assert report["steps"] == 4 and report["data"]["kind"] == "loader"
    assert [layer["name"] for layer in report["layers"]] == [layer["name"] for layer in cli.report["layers"]]
    assert report["collectives"] == cli.report["collectives"]
    assert "recalibrated 5 BN layers on 24 samples" in repr(report)
    assert str(report) == repr(report) and len(str(report)) < 1000  # print(report): the short summary


def test_a_model_defined_here_from_dict_batches_with_forward(warm_live):
    torch.manual_seed(1)
    net = perturbed(OwnNet()).eval()
    net.train()  # the caller's mode is the caller's: kept, while the ranks run in eval mode
    images, extra = torch.randn(19, 3, 6, 6) * 2 + 1, torch.randn(19, 2) - 0.5
    expected = reference_statistics(TwoInputs(net), torch.cat([images.flatten(1), extra], 1), 5)
    before = state(net)
    loader = DataLoader(Records(images, extra), batch_size=5)
    report = bnrecal.recalibrate(net, loader, workers=2, forward=feed_record, progress=False)
    assert_matches_reference(TwoInputs(net), expected)
    assert_only_bn_buffers_changed(before, net, steps=4)
    assert net.training
    assert report["model"]["transport"] == "pickle" and report["model"]["name"] == "OwnNet"
    assert report["samples"] == 19 and report["collectives"] == 2 * 4


def test_a_map_style_dataset_with_batch_size_travels_as_a_program(mixed, warm_live):
    model, samples, _, _ = mixed
    live = copy.deepcopy(model)
    before = state(live)
    report = bnrecal.recalibrate(live, Pairs(samples), batch_size=6, workers=2, max_samples=17, progress=False)
    assert_matches_reference(live, reference_statistics(model, samples[:17], 6))
    assert_only_bn_buffers_changed(before, live, steps=3)
    assert report["model"]["transport"] == "program" and report["samples"] == 17


def test_an_iterable_of_tuples_with_numpy_counts(mixed, warm_live):
    model, samples, _, _ = mixed
    live = copy.deepcopy(model)
    before = state(live)
    batches = ((samples[i:i + 8], torch.arange(i, min(i + 8, 24))) for i in range(0, 24, 8))  # a generator
    report = bnrecal.recalibrate(live, batches, workers=np.int64(2), max_samples=np.int64(20), progress=False)
    assert_matches_reference(live, reference_statistics(model, samples[:20], 8, world_size=2))
    assert_only_bn_buffers_changed(before, live, steps=3)
    assert report["data"].to_dict() == {"kind": "batches", "source": "generator of batches", "samples": 20, "steps": 3,
                              "total_samples": 24, "sample_shape": [3, 6, 6]}


def test_an_exported_program_is_recalibrated_in_place(mixed, warm_live):
    model, samples, _, _ = mixed
    program = torch.export.export(copy.deepcopy(model).eval(), (samples[:4],))
    bnrecal.recalibrate(program, samples, batch_size=7, progress=False)
    expected = reference_statistics(model, samples, 7)
    for name, (mean, var) in expected.items():
        got_mean, got_var = program.state_dict[f"{name}.running_mean"], program.state_dict[f"{name}.running_var"]
        torch.testing.assert_close(got_mean.double(), mean, rtol=0, atol=1e-4 * float(var.sqrt().max()) + 1e-6)
        torch.testing.assert_close(got_var.double(), var, rtol=1e-4, atol=0)


def test_what_data_takes_a_path_runs_on_the_same_engine(mixed, warm_live):
    model, samples, _, data = mixed
    live = copy.deepcopy(model)
    before = state(live)
    report = bnrecal.recalibrate(live, data, batch_size=6, workers=2, max_samples=18, progress=False)
    assert_matches_reference(live, reference_statistics(model, in_contract_order(samples)[:18], 6))
    assert_only_bn_buffers_changed(before, live, steps=3)
    assert report["data"]["kind"] == "array" and report["model"]["transport"] == "program"


class Stream(IterableDataset):
    """An iterable-style dataset: it has no indices to shard, so its batches are read on the driver."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __iter__(self):
        yield from self.x


def test_a_shuffled_loader_and_an_iterable_dataset(mixed, warm_live):
    model, samples, _, _ = mixed
    order = torch.randperm(24, generator=torch.Generator().manual_seed(5))  # what RandomSampler draws
    expected = reference_statistics(model, samples[order], 6, world_size=2, mode="local")
    shuffled = DataLoader(TensorDataset(samples), batch_size=6, shuffle=True,
                          generator=torch.Generator().manual_seed(5))
    live = copy.deepcopy(model)
    bnrecal.recalibrate(live, shuffled, workers=2, mode="local", progress=False)
    assert_matches_reference(live, expected)
    live = copy.deepcopy(model)
    report = bnrecal.recalibrate(live, DataLoader(Stream(samples), batch_size=6), workers=2, mode="local",
                                 progress=False)
    assert_matches_reference(live, reference_statistics(model, samples, 6, world_size=2, mode="local"))
    assert report["data"]["kind"] == "batches"
