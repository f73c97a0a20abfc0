"""BN layers as users bring them, on a real local Ray cluster with the GLOO collective."""

from __future__ import annotations

import time

import pytest
import torch

from bnrecal.errors import CallOrderError, UnsupportedLayerError

from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import save_array, save_state
from tests.nets import branching_net, perturbed, self_stats_net, subclass_net, sync_bn_net, untracked_net
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_sync_batchnorm_model_on_two_gloo_actors_never_uses_its_own_sync(settings, tmp_path, warm_pool):
    """The actors' GLOO group initialises torch.distributed: a SyncBatchNorm in training
    mode would try to all-reduce over it (and refuse CPU tensors). Ours is the only collective."""
    torch.manual_seed(0)
    model = perturbed(sync_bn_net())
    samples = torch.randn(21, 3, 7, 6) + 0.2
    request = RecalibrationRequest(
        arch="tests.nets:sync_bn_net", checkpoint=save_state(tmp_path / "m.pt", model),
        data=save_array(tmp_path / "x.npy", samples), workers=2, batch_size=6,
    )
    result = recalibrate(request, settings, pool=warm_pool)
    assert_matches_reference(result.model, reference_statistics(model, in_contract_order(samples), 6))
    report = result.report
    assert {entry["class"] for entry in report["layers"]} == {"SyncBatchNorm"}
    assert report["collectives"] == 4 * 4  # bn, shared twice, bn_act: 4 calls a step, 4 steps


def test_a_layer_without_running_statistics_normalises_with_the_global_batch(settings, tmp_path, warm_pool):
    """A track_running_stats=False layer normalises with batch statistics: in sync mode the
    global batch's (one more allreduce per call), so every layer after it sees the same
    values at any K; in local mode each rank's own slice."""
    torch.manual_seed(2)
    model = perturbed(untracked_net())
    samples = torch.randn(26, 3, 6, 6) * 1.4 + 0.3
    checkpoint, data = save_state(tmp_path / "m.pt", model), save_array(tmp_path / "x.npy", samples)

    def run(workers: int, mode: str = "sync"):
        request = RecalibrationRequest(
            arch="tests.nets:untracked_net", checkpoint=checkpoint, data=data, workers=workers, batch_size=8, mode=mode,
        )
        return recalibrate(request, settings, pool=warm_pool)

    expected = reference_statistics(model, in_contract_order(samples), 8)
    results = {k: run(k) for k in (1, 2, 4)}  # the last step of 2 samples leaves ranks 2 and 3 empty at K=4
    for k, result in results.items():
        assert_matches_reference(result.model, expected)
        assert result.report["collectives"] == 3 * 4  # two layers and the untracked call, 4 steps
        assert [s["name"] for s in result.report["skipped"]] == ["bn_untracked"]
    for k in (2, 4):
        for key, value in results[k].updates.items():
            torch.testing.assert_close(value.double(), results[1].updates[key].double(), rtol=1e-5, atol=1e-7)
    local = run(2, "local")
    assert_matches_reference(local.model, reference_statistics(model, in_contract_order(samples), 8, world_size=2, mode="local"))
    assert local.report["collectives"] == 1


def test_subclass_and_twice_called_layer_on_two_ranks(settings, tmp_path, warm_pool):
    torch.manual_seed(1)
    model = perturbed(subclass_net(timm_act=True))
    samples = torch.randn(17, 3, 7, 6) * 1.5
    request = RecalibrationRequest(
        arch="tests.nets:subclass_net", model_kwargs={"timm_act": True},
        checkpoint=save_state(tmp_path / "m.pt", model), data=save_array(tmp_path / "x.npy", samples),
        workers=2, batch_size=5, mode="local",
    )
    result = recalibrate(request, settings, pool=warm_pool)
    assert_matches_reference(result.model, reference_statistics(model, in_contract_order(samples), 5, world_size=2, mode="local"))
    classes = {entry["name"]: entry["class"] for entry in result.report["layers"]}
    assert classes == {"bn": "ActBatchNorm2d", "shared": "BatchNorm2d", "bn_act": "BatchNormAct2d"}
    assert {entry["name"]: entry["calls"] for entry in result.report["layers"]}["shared"] == 2 * 4


def test_a_layer_that_cannot_be_calibrated_fails_before_any_actor_starts(settings, tmp_path):
    model = self_stats_net()
    request = RecalibrationRequest(
        arch="tests.nets:self_stats_net", checkpoint=save_state(tmp_path / "m.pt", model),
        data=save_array(tmp_path / "x.npy", torch.randn(8, 3, 7, 6)), workers=2, batch_size=4,
    )
    started = time.monotonic()
    with pytest.raises(UnsupportedLayerError, match=r"'bn' of class tests\.nets\.SelfStatsBatchNorm2d"):
        recalibrate(request, settings)
    assert time.monotonic() - started < 3.0  # the driver's probe, no actors


def branching_request(tmp_path, samples, workers, batch_size):
    return RecalibrationRequest(
        arch="tests.nets:branching_net", checkpoint=save_state(tmp_path / "m.pt", branching_net()),
        data=save_array(tmp_path / "x.npy", samples), workers=workers, batch_size=batch_size,
    )


def test_ranks_calling_layers_in_different_orders_fail_the_job(settings, tmp_path, warm_pool):
    # The failing job takes the module's warm pair of ranks (its gang is killed, never reused).
    samples = torch.randn(16, 4) * 0.1
    samples[[0, 1, 2, 3, 8, 9, 10, 11]] += 2.0  # rank 0's slices go a -> b, rank 1's go b -> a
    samples[[4, 5, 6, 7, 12, 13, 14, 15]] -= 2.0
    request = branching_request(tmp_path, samples, workers=2, batch_size=8)
    with pytest.raises(CallOrderError, match=r"reduced BN layer '(a|b)' \(BatchNorm1d\) while another rank"):
        recalibrate(request, settings, pool=warm_pool)
    local = recalibrate(request.model_copy(update={"mode": "local"}), settings, pool=warm_pool)  # no per-step collective to mix up
    assert local.report["collectives"] == 1


def test_a_rank_replaying_an_empty_slice_in_the_wrong_order_fails_the_job(settings, tmp_path):
    samples = torch.randn(10, 4) * 0.1 + 2.0  # the probe and step 0 go a -> b
    samples[8:] -= 4.0  # step 1: ranks 0 and 1 go b -> a, rank 2 (empty) replays a -> b
    with pytest.raises(CallOrderError, match="while another rank reduced a different layer"):
        recalibrate(branching_request(tmp_path, samples, workers=3, batch_size=8), settings)
