"""``bnrecal.recalibrate`` refuses bad input with typed errors and one-line messages, on
the driver before any rank starts where it can tell; a forward that fails on a rank fails
the call with that rank's one line."""

from __future__ import annotations

import copy
import re
import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import bnrecal
from bnrecal.workers.ranks.gangs.pool import Gang
from tests.nets import mixed_net, no_norm_net, perturbed
from tests.service.live.guest import snapshot
from tests.service.live.helpers import state

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return perturbed(mixed_net()).eval()


def samples(count: int = 8) -> torch.Tensor:
    return torch.randn(count, 3, 6, 6)


def refused(error: type[bnrecal.BnrecalError], model: torch.nn.Module, data: object, **options: object) -> str:
    """Recalibrating fails with ``error``, one line, and leaves the model as it was."""
    before = state(model)
    with pytest.raises(error) as caught:
        bnrecal.recalibrate(model, data, progress=False, **options)
    message = str(caught.value)
    assert "\n" not in message and message
    after = model.state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items())
    return message


def test_a_model_without_batchnorm():
    message = refused(bnrecal.NoBatchNormError, no_norm_net(), [samples()])
    assert message == "model NoNormNet has no BatchNorm layer to recalibrate"


@pytest.mark.parametrize("data", [[], DataLoader(TensorDataset(torch.empty(0, 3, 6, 6)), batch_size=4), iter([])])
def test_empty_data(model, data):
    assert "holds no samples" in refused(bnrecal.DatasetError, model, data)


def test_a_forward_that_raises_gives_its_message(model):
    def forward(net, batch):
        raise ValueError("tokenizer missing\nsecond line of detail")

    message = refused(bnrecal.ModelInputError, model, [samples()], forward=forward)
    assert message == "forward(model, batch) failed: ValueError: tokenizer missing"


def test_a_batch_of_the_wrong_shape(model):
    message = refused(bnrecal.ModelInputError, model, [torch.randn(4, 5)])
    assert message.startswith("the model rejects samples of shape (5,)")


def test_dict_batches_need_forward(model):
    message = refused(bnrecal.ModelInputError, model, [{"image": samples()}])
    assert message.startswith("a batch is a dict: give forward=")


@pytest.mark.parametrize(
    ("data", "options", "field"),
    [
        (42, {}, "data"),
        (TensorDataset(samples()), {}, "batch_size"),
        (DataLoader(TensorDataset(samples()), batch_size=4), {"batch_size": 4}, "batch_size"),
        ([samples()], {"workers": 0}, "workers"),
        ([samples()], {"workers": "2"}, "workers"),
        ([samples()], {"mode": "fast"}, "mode"),
        ([samples()], {"max_samples": 0}, "max_samples"),
    ],
)
def test_bad_options_name_their_field(model, data, options, field):
    with pytest.raises(bnrecal.SpecError) as caught:
        bnrecal.recalibrate(model, data, progress=False, **options)
    assert caught.value.field == field and "\n" not in str(caught.value)


@pytest.mark.usefixtures("warm_live")  # a failed call's ranks are killed, not kept: the pool lends, never gets back
def test_a_forward_that_fails_on_a_rank_fails_the_call_with_its_line(model):
    live = copy.deepcopy(model)

    def forward(net, batch):
        x, index = batch
        if int(index.max()) >= 12:
            raise RuntimeError(f"sample {int(index.max())} is corrupt")
        return net(x)

    data = DataLoader(TensorDataset(samples(16), torch.arange(16)), batch_size=4)
    message = refused(bnrecal.RunError, live, data, workers=2, forward=forward)
    assert re.match(r"rank [01] on node \w+ failed: RuntimeError: sample 1[35] is corrupt$", message), message


class Locked(torch.utils.data.Dataset):
    """A dataset holding a lock: it cannot be pickled for the ranks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.x = torch.randn(8, 3, 6, 6)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.x[index]


def test_what_cannot_be_pickled_is_named_before_any_worker_starts(model, monkeypatch):
    started = []
    real_start = Gang.start.__func__
    monkeypatch.setattr(Gang, "start", classmethod(lambda cls, *a, **k: started.append(a) or real_start(cls, *a, **k)))
    message = refused(bnrecal.SpecError, model, DataLoader(Locked(), batch_size=4), workers=2)
    assert message.startswith(
        "the dataset (or its collate_fn) cannot be sent to the Ray workers: TypeError: cannot pickle"
    )
    locked = copy.deepcopy(model)
    locked.lock = threading.Lock()
    message = refused(bnrecal.SpecError, locked, [samples()], forward=lambda net, batch: net(batch), workers=2)
    assert message.startswith("the model cannot be sent to the Ray workers: TypeError: cannot pickle")
    assert started == []  # no rank gang was started for either
    monkeypatch.undo()
    before = snapshot(locked)  # one worker in this process sends nothing: the model runs itself, put back after
    report = bnrecal.recalibrate(locked, [samples()], forward=lambda net, batch: net(batch), progress=False)
    assert report["backend"] == "in-process" and "does not deep-copy" in report["model"]["notes"][0]
    assert before["#training"] == locked.training and before.keys() == snapshot(locked).keys()
