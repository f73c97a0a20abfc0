"""The calibration math in one process (no Ray), against the float64 reference."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from bnrecal.workers.engine.batchnorm import find_batchnorm_layers
from bnrecal.workers.engine.statistics_pass import apply_statistics, calibration_pass
from bnrecal.workers.engine.calibrator import BatchNormCalibrator, probe_call_order
from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.workers.engine.moments import batch_moments, finalize, pack, packed_size
from bnrecal.errors import DatasetError, ModelInputError
from bnrecal.workers.ranks.sharding import num_steps, rank_ranges

from tests.nets import far_from_zero_net, mixed_net, no_norm_net, perturbed, volume_net
from tests.reference import assert_matches_reference, reference_statistics


def run_one_process(model, samples, batch_size, mode="sync"):
    layers, _ = find_batchnorm_layers(model)
    batches = [samples[s : s + batch_size] for s in range(0, len(samples), batch_size)]
    collective = SingleProcessCollective()
    result = calibration_pass(model, layers, batches, mode=mode, collective=collective)
    apply_statistics(layers, result.stats, result.steps)
    return result


@pytest.mark.parametrize(
    ("factory", "shape"),
    [(mixed_net, (3, 6, 5)), (volume_net, (2, 4, 3, 5))],
    ids=["bn1d-bn2d-depthwise-affine-false-dropout", "bn3d"],
)
@pytest.mark.parametrize("mode", ["sync", "local"])
def test_one_process_matches_reference(factory, shape, mode):
    torch.manual_seed(0)
    model = perturbed(factory())
    samples = torch.randn(23, *shape) * 2 + 0.5  # 23 = 4 steps of 6 + an uneven last step
    expected = reference_statistics(model, samples, batch_size=6, mode=mode)
    run_one_process(model, samples, 6, mode)
    assert_matches_reference(model, expected)


def test_collective_counts_follow_the_contract():
    model = perturbed(mixed_net())
    samples = torch.randn(20, 3, 6, 5)
    layers, _ = find_batchnorm_layers(model)
    sync = run_one_process(model, samples, 8, "sync")
    assert sync.collectives == len(layers) * num_steps(20, 8)
    local = run_one_process(perturbed(mixed_net()), samples, 8, "local")
    assert local.collectives == 1


def test_variance_survives_a_mean_far_from_zero():
    torch.manual_seed(1)
    model = far_from_zero_net()
    samples = (1e3 + 1e-2 * torch.randn(4000, 3)).float()
    expected = reference_statistics(model, samples, batch_size=256)
    run_one_process(model, samples, 256)
    assert_matches_reference(model, expected)
    var = model.bn.running_var.double()
    assert torch.allclose(var, torch.full_like(var, 1e-4), rtol=0.1)


def test_only_bn_statistics_change():
    model = perturbed(mixed_net())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = run_one_process(model, torch.randn(10, 3, 6, 5), 4)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        if key.endswith(("running_mean", "running_var")) and "bn" in key:
            assert not torch.equal(value, after[key]), key
        elif key.endswith("num_batches_tracked"):
            assert after[key].item() == value.item() + result.steps
        else:
            assert torch.equal(value, after[key]), key
            assert value.dtype == after[key].dtype


def test_layers_are_restored_and_dropout_stays_off():
    model = mixed_net().eval()
    layers, _ = find_batchnorm_layers(model)
    tracked = [layer.module.num_batches_tracked.clone() for layer in layers]
    with torch.inference_mode(), BatchNormCalibrator(layers, "sync", SingleProcessCollective()):
        assert all(layer.module.training for layer in layers)
        assert not model.drop.training
        model(torch.randn(4, 3, 6, 5))
    assert not any(layer.module.training for layer in layers)
    assert [layer.module.num_batches_tracked for layer in layers] == tracked
    x = torch.randn(4, 3, 6, 5)
    model_a = perturbed(mixed_net())
    model_b = copy.deepcopy(model_a)
    torch.manual_seed(7)
    run_one_process(model_a, x, 4)
    torch.manual_seed(123)
    run_one_process(model_b, x, 4)
    assert torch.equal(model_a.bn_fc.running_var, model_b.bn_fc.running_var)


def test_skipped_layers_are_named():
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3, track_running_stats=False))
    layers, skipped = find_batchnorm_layers(model)
    assert [layer.name for layer in layers] == ["0"]
    assert skipped[0].name == "1" and "track_running_stats" in skipped[0].reason
    assert find_batchnorm_layers(no_norm_net()) == ([], [])


def test_call_order_and_shape_rejection():
    model = mixed_net()
    layers, _ = find_batchnorm_layers(model)
    order = probe_call_order(model, layers, torch.randn(1, 3, 6, 5))
    assert [layers[i].name for i in order] == ["bn", "bn_dw", "bn_plain", "bn_seq", "bn_fc"]
    with pytest.raises(ModelInputError, match=r"rejects samples of shape \(5, 6, 5\)"):
        probe_call_order(model, layers, torch.randn(1, 5, 6, 5))


def test_moments_of_an_empty_slice_are_zero():
    shift = torch.zeros(4, dtype=torch.float64)
    packed = pack(batch_moments(torch.empty(0, 4, 3)), shift, torch.empty(packed_size(4), dtype=torch.float64))
    assert packed.shape == (9,) and not packed.any()
    x = torch.randn(7, 4, 3, dtype=torch.float32)
    shift = torch.full((4,), 5.0, dtype=torch.float64)
    packed = pack(batch_moments(x), shift, torch.empty(packed_size(4), dtype=torch.float64))
    stats = finalize(packed, shift)
    values = x.double().transpose(0, 1).reshape(4, -1)
    assert torch.allclose(stats.mean, values.mean(1), atol=1e-6)
    assert torch.allclose(stats.unbiased_var, values.var(1), rtol=1e-5)


@pytest.mark.parametrize(("n", "b", "k"), [(10, 4, 3), (5, 4, 3), (2, 8, 4), (33, 32, 2), (7, 7, 1)])
def test_rank_ranges_follow_array_split(n, b, k):
    per_rank = [rank_ranges(n, b, k, rank) for rank in range(k)]
    assert all(len(r) == num_steps(n, b) for r in per_rank)
    for step in range(num_steps(n, b)):
        parts = np.array_split(np.arange(step * b, min((step + 1) * b, n)), k)
        for rank in range(k):
            start, stop = per_rank[rank][step]
            assert list(range(start, stop)) == parts[rank].tolist()


@pytest.mark.parametrize("mode", ["sync", "local"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_sample_fails_its_step_naming_the_sample_and_the_first_layer(mode, bad):
    torch.manual_seed(0)
    model = perturbed(mixed_net())
    samples = torch.randn(23, 3, 6, 5)
    samples[13, 1, 2, 3] = bad  # step 2 of batch 6: samples 12-17
    layers, _ = find_batchnorm_layers(model)
    batches = [samples[s : s + 6] for s in range(0, 23, 6)]
    steps_done = []
    with pytest.raises(DatasetError) as info:
        calibration_pass(model, layers, batches, mode=mode, collective=SingleProcessCollective(),
                         on_step=lambda step, _: steps_done.append(step))
    assert str(info.value) == (
        "calibration sample 13 has non-finite values (NaN or inf), first seen by BN layer 'bn' (BatchNorm2d) "
        "in step 2 (samples 12-17): fix or leave out that sample"
    )
    assert type(info.value) is DatasetError  # answers 422 /dataset (bnrecal.service.jobserver.problems)
    assert steps_done == [0, 1]  # found at the end of the step that saw it, not at the end of the pass


def test_non_finite_values_from_the_model_name_the_layer_that_first_saw_them_and_the_samples():
    torch.manual_seed(0)
    model = perturbed(mixed_net())
    with torch.no_grad():
        model.depthwise.weight[2] = float("inf")
    layers, _ = find_batchnorm_layers(model)
    samples = torch.randn(10, 3, 6, 5)
    with pytest.raises(DatasetError) as info:  # global indices: this rank's slices start at 100
        calibration_pass(model, layers, [samples[:4], samples[4:]], mode="sync", collective=SingleProcessCollective(),
                         sample_ranges=[(100, 104), (104, 110)], step_ranges=[(100, 104), (104, 110)])
    assert str(info.value).startswith(
        "non-finite values (NaN or inf) first reached BN layer 'bn_dw' (BatchNorm2d) in step 0 (samples 100-103): "
    )

