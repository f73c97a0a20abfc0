"""``bnrecal.recalibrate_many``: a generator of models over named sets, each cell exactly
``bnrecal.recalibrate`` of its model and set (and the independent reference), yielded as it
finishes, models read one at a time, a failing cell failing alone (docs/sweeps.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import bnrecal
from bnrecal.workers.ranks.gangs.warm_context import warm_ranks
from tests.nets import mixed_net, no_norm_net, perturbed
from tests.reference import assert_matches_reference, reference_statistics
from tests.service.live.helpers import assert_only_bn_buffers_changed, state

SETS = {"day": torch.randn(24, 3, 6, 5, generator=torch.Generator().manual_seed(1)),
        "night": 0.3 * torch.randn(24, 3, 6, 5, generator=torch.Generator().manual_seed(2)) - 1}


def _models(count: int, made: list[int]):
    for index in range(count):
        made.append(index)
        yield perturbed(mixed_net(), index)


def test_cells_stream_in_order_from_a_generator_read_one_model_at_a_time():
    made: list[int] = []
    seen = []
    for cell in bnrecal.recalibrate_many(_models(3, made), SETS, batch_size=8):
        assert cell.ok, cell.error
        assert made == list(range(cell.model_index + 1))  # the next model is not made before its cells are done
        seen.append((cell.model_index, cell.set_name))
    assert seen == [(0, "day"), (0, "night"), (1, "day"), (1, "night"), (2, "day"), (2, "night")]


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("workers", [1, 2])
def test_each_cell_is_the_single_recalibrate_of_its_model_and_set(request, workers):
    if workers > 1:  # the sweep and the single calls on the module's warm ranks, as a caller's loop would be
        request.getfixturevalue("warm_live")
    models = [perturbed(mixed_net(), seed) for seed in range(2)]
    given = [copy.deepcopy(model) for model in models]
    before = [state(model) for model in models]
    cells = list(bnrecal.recalibrate_many(iter(models), SETS, batch_size=8, workers=workers))
    assert [cell.status.value for cell in cells] == ["succeeded"] * 4
    for cell in cells:
        single = copy.deepcopy(given[cell.model_index])
        report = bnrecal.recalibrate(single, SETS[cell.set_name], batch_size=8, workers=workers, progress=False)
        expected = {key: value for key, value in single.state_dict().items() if key in cell.statistics}
        assert expected.keys() == cell.statistics.keys()
        for key, value in expected.items():
            assert torch.equal(cell.statistics[key], value), (cell.model_index, cell.set_name, key)
        assert cell.report.layers == report.layers and cell.report.steps == report.steps
        reference = reference_statistics(given[cell.model_index], SETS[cell.set_name], 8)
        assert_matches_reference(single, reference)
    for model, old in zip(models, before, strict=True):  # in place: the last set's statistics, one set's steps
        assert_only_bn_buffers_changed(old, model, steps=3)
        assert torch.equal(model.bn.running_mean, cells[2 * models.index(model) + 1].statistics["bn.running_mean"])


def test_a_failing_cell_fails_alone():
    loader = DataLoader(TensorDataset(SETS["day"]), batch_size=8)
    cells = list(bnrecal.recalibrate_many([perturbed(mixed_net()), no_norm_net(), "not a model", perturbed(mixed_net(), 1)],
                                          loader))
    assert [(cell.model_index, cell.status.value) for cell in cells] == [
        (0, "succeeded"), (1, "failed"), (2, "failed"), (3, "succeeded")]
    assert isinstance(cells[1].error, bnrecal.BnrecalError) and "BatchNorm" in cells[1].error.message
    assert "models[2] is a str" in cells[2].error.message
    assert cells[1].report is None and cells[3].report.samples == 24


def test_bad_data_is_refused_before_any_model_is_read():
    made: list[int] = []
    with pytest.raises(bnrecal.SpecError, match="set name '../x'"):
        bnrecal.recalibrate_many(_models(2, made), {"../x": SETS["day"]}, batch_size=8)  # at the call
    assert made == []


@pytest.mark.usefixtures("ray_cluster")
def test_a_lost_rank_reruns_only_its_cell_and_a_rank_that_always_dies_fails_only_its_own(monkeypatch, tmp_path, warm_pool):
    from tests.nets import MARKER, marker_net

    monkeypatch.setenv("BNRECAL_MAX_RETRIES", "1")
    clean = torch.randn(16, 4, generator=torch.Generator().manual_seed(3))
    marked = clean.clone()
    marked[-1, 0] = MARKER  # the last sample: rank 1's part of the last step
    models = [marker_net("exit_once", str(tmp_path)), marker_net("exit"), marker_net("exit_once", str(tmp_path))]
    for seed, model in enumerate(models):
        perturbed(model, seed)
    given = [copy.deepcopy(model) for model in models]
    cells = list(bnrecal.recalibrate_many(models, {"clean": clean, "marked": marked}, batch_size=8, workers=2))
    status = {(cell.model_index, cell.set_name): cell for cell in cells}
    assert [key for key in status if not status[key].ok] == [(1, "marked")]  # it dies on every attempt
    assert "after 1 retries" in status[1, "marked"].error.message
    assert status[0, "marked"].report.attempts == 2 and len(status[0, "marked"].report.retried_failures) == 1
    assert all(status[key].report.attempts == 1 for key in status if key not in ((0, "marked"), (1, "marked")))
    single = copy.deepcopy(given[0])  # the retried cell's statistics are those of a run that never failed
    with warm_ranks(warm_pool):  # the module's warm ranks (the sweep above ran on fresh ones: it is about losing them)
        bnrecal.recalibrate(single, marked, batch_size=8, workers=2, progress=False)
    for key, value in status[0, "marked"].statistics.items():
        assert torch.equal(value, single.state_dict()[key]), key
