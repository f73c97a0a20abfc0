"""Python-object calibration data (``workers.data.formats.loader``): each rank's part of every step
is its ``numpy.array_split`` part (docs/calibration.md, "Sharding"), for a dataset read through the
rank's own DataLoader and for batches materialised on the driver alike."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from bnrecal.workers.data.formats.loader import LoaderSpec, batch_length, model_input, slice_batch
from bnrecal.errors import DatasetError, ModelInputError


class Indexed(Dataset):
    """Sample i is {"x": a tensor holding i, "tag": str(i)}; records which indices were read."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, object]:
        self.read.append(index)
        return {"x": torch.full((2,), float(index)), "tag": str(index)}


STEPS = ((7, 3, 9, 1, 0), (4,), (2, 8, 5, 6))  # a shuffled sampler's steps, one smaller than K=3


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_rank_decodes_only_its_array_split_part_of_every_step(world_size):
    sizes = tuple(len(step) for step in STEPS)
    seen: list[list[int]] = [[] for _ in STEPS]
    for rank in range(world_size):
        dataset = Indexed(10)
        spec = LoaderSpec(kind="loader", sizes=sizes, sample_shape=(2,), total_samples=10, source="test",
                          select_input=False, dataset=dataset, collate_fn=default_collate, indices=STEPS)
        steps = list(spec.rank_steps(rank, world_size))
        assert len(steps) == len(STEPS)  # every rank takes part in every step, also with an empty part
        for j, step in enumerate(steps):
            part = np.array_split(np.asarray(STEPS[j]), world_size)[rank].tolist()
            assert step.size == len(part)
            if part:
                assert step.value["x"][:, 0].tolist() == part and step.value["tag"] == [str(i) for i in part]
                seen[j] += part
            else:
                assert step.value is None
        assert sorted(dataset.read) == sorted(i for step in STEPS for i in np.array_split(step, world_size)[rank])
        assert spec.rank_ranges(rank, world_size)[1] == ((5, 6) if rank == 0 else (5, 5))  # global positions
    assert [tuple(s) for s in seen] == list(STEPS)


def test_materialised_batches_are_sliced_keeping_their_structure():
    Pair = namedtuple("Pair", "x y")
    batch = {"x": torch.arange(5.0), "pair": Pair(np.arange(5), ["a", "b", "c", "d", "e"]), "meta": "same"}
    spec = LoaderSpec(kind="batches", sizes=(5,), sample_shape=(), total_samples=5, source="test",
                      select_input=False, batches=(batch,))
    parts = [next(spec.rank_steps(rank, 2)).value for rank in range(2)]
    assert parts[1]["x"].tolist() == [3.0, 4.0] and parts[1]["pair"].y == ["d", "e"]
    assert isinstance(parts[0]["pair"], Pair) and parts[0]["pair"].x.tolist() == [0, 1, 2]
    assert parts[0]["meta"] == "same"
    assert batch_length(batch) == 5 and batch_length((["a", "b"], 3)) == 2
    assert slice_batch([torch.zeros(4, 2), torch.ones(4)], 1, 3)[0].shape == (2, 2)


def test_the_model_input_of_a_batch():
    x = torch.zeros(3, 2)
    assert model_input(x) is x and model_input((x, [1, 2, 3])) is x and model_input([np.zeros((3, 2))]).shape == (3, 2)
    with pytest.raises(ModelInputError, match="a batch is a dict"):
        model_input({"x": x})
    with pytest.raises(DatasetError, match="0-dimensional"):
        batch_length(torch.tensor(1.0))
