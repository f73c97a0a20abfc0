"""``bnrecal.recalibrate`` with ``max_samples="auto"``: data in memory keeps its own order (the
loader decides, as with ``update_bn``), a path is read in the fair order, and the report says
where the statistics converged."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import bnrecal
from bnrecal.errors import SpecError

from tests.nets import mixed_net, perturbed
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def model_and_samples() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(6)
    return perturbed(mixed_net()).eval(), torch.randn(640, 3, 6, 5) * 1.3


def test_a_loader_keeps_its_order_and_auto_stops_at_a_step_of_its_own(model_and_samples, warm_live):
    model, samples = model_and_samples
    live = copy.deepcopy(model)
    report = bnrecal.recalibrate(
        live, DataLoader(TensorDataset(samples), batch_size=16), workers=2, max_samples="auto", tolerance=0.1,
        progress=False,
    )
    assert report["convergence"]["converged"] and report["order"] == "given"
    used = report["samples"]
    assert used < 640 and used % 16 == 0
    assert_matches_reference(live, reference_statistics(model, samples[:used], 16))


def test_a_path_is_read_in_the_fair_order(model_and_samples, warm_live, tmp_path):
    model, samples = model_and_samples
    np.save(tmp_path / "x.npy", samples.numpy())
    live = copy.deepcopy(model)
    report = bnrecal.recalibrate(live, str(tmp_path / "x.npy"), batch_size=16, max_samples=96, progress=False)
    assert (report["order"], report["seed"]) == ("shuffled", 0)
    assert_matches_reference(live, reference_statistics(model, in_contract_order(samples)[:96], 16))


def test_auto_in_local_mode_is_refused_before_any_work(model_and_samples):
    model, samples = model_and_samples
    with pytest.raises(SpecError, match="needs mode sync"):
        bnrecal.recalibrate(copy.deepcopy(model), samples, batch_size=16, mode="local", max_samples="auto")
