"""BN layers as users bring them, in one process: each layer's own forward runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bnrecal.workers.engine.batchnorm import find_batchnorm_layers
from bnrecal.workers.engine.statistics_pass import apply_statistics, calibration_pass
from bnrecal.workers.engine.calibrator import probe_call_order
from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.errors import UnsupportedLayerError

from tests.nets import far_from_zero_net, mixed_net, perturbed, self_stats_net, subclass_net, sync_bn_net, volume_net
from tests.reference import assert_matches_reference, reference_statistics


def calibrate(model, samples, batch_size, mode="sync", memory_format="auto"):
    layers, _ = find_batchnorm_layers(model)
    batches = [samples[s : s + batch_size] for s in range(0, len(samples), batch_size)]
    result = calibration_pass(
        model, layers, batches, mode=mode, collective=SingleProcessCollective(), memory_format=memory_format
    )
    apply_statistics(layers, result.stats, result.steps)
    return result


@pytest.mark.parametrize("mode", ["sync", "local"])
@pytest.mark.parametrize("timm_act", [False, True], ids=["subclass", "timm-bn-act"])
def test_subclass_logic_runs_and_a_layer_called_twice_counts_both_calls(mode, timm_act):
    torch.manual_seed(0)
    model = perturbed(subclass_net(timm_act=timm_act))
    samples = torch.randn(22, 3, 7, 6) * 1.3 + 0.4
    expected = reference_statistics(model, samples, batch_size=8, mode=mode)
    result = calibrate(model, samples, 8, mode)
    assert_matches_reference(model, expected)
    layers, _ = find_batchnorm_layers(model)
    assert dict(zip((layer.name for layer in layers), result.calls))["shared"] == 2 * 3


def test_activation_inside_the_layer_changes_what_follows():
    """Dropping the subclass's activation (the engine v1 bug) would move the next layer's
    statistics far more than the tolerance: the test above would catch it."""
    torch.manual_seed(0)
    model = perturbed(subclass_net())
    samples = torch.randn(16, 3, 7, 6)
    with_act = reference_statistics(model, samples, batch_size=8)
    plain = perturbed(subclass_net())
    plain.bn.__class__ = nn.BatchNorm2d
    without = reference_statistics(plain, samples, batch_size=8)
    assert not torch.allclose(with_act["shared"][1], without["shared"][1], rtol=1e-2)


@pytest.mark.parametrize("memory_format", ["channels_last", "contiguous", "auto"])
def test_channels_last_inputs_and_layouts_give_the_same_statistics(memory_format):
    torch.manual_seed(0)
    model = perturbed(subclass_net())
    samples = (torch.randn(20, 3, 7, 6) * 2 - 0.5).contiguous(memory_format=torch.channels_last)
    expected = reference_statistics(model, samples, batch_size=6)
    result = calibrate(model, samples, 6, memory_format=memory_format)
    assert_matches_reference(model, expected)
    assert result.memory_format == ("channels_last" if memory_format == "auto" else memory_format)
    assert all(p.is_contiguous() for p in model.parameters())


@pytest.mark.parametrize(
    ("factory", "shape"), [(mixed_net, (3, 6, 5)), (volume_net, (2, 4, 3, 5))], ids=["bn1d-nc-ncl", "bn3d"]
)
def test_auto_layout_on_1d_and_3d_layers(factory, shape):
    torch.manual_seed(0)
    model = perturbed(factory())
    samples = torch.randn(18, *shape)
    expected = reference_statistics(model, samples, batch_size=5)
    result = calibrate(model, samples, 5)
    assert_matches_reference(model, expected)
    assert result.memory_format == "channels_last"  # 4-D and 5-D batches
    assert all(p.is_contiguous() for p in model.parameters())


def test_sync_batchnorm_converted_model_in_one_process():
    torch.manual_seed(0)
    model = perturbed(sync_bn_net())
    assert any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    samples = torch.randn(12, 3, 7, 6)
    expected = reference_statistics(model, samples, batch_size=4)
    calibrate(model, samples, 4)
    assert_matches_reference(model, expected)


@pytest.mark.parametrize("ratio", [1e4, 1e5])
def test_means_far_from_zero_keep_their_variance_downstream(ratio):
    torch.manual_seed(3)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3), nn.BatchNorm1d(3))
    perturbed(model)
    samples = (ratio + torch.randn(600, 3)).float()
    expected = reference_statistics(model, samples, batch_size=64)
    calibrate(model, samples, 64)
    assert_matches_reference(model, expected)


def test_far_from_zero_net_still_exact():
    model = far_from_zero_net()
    samples = (1e3 + 1e-2 * torch.randn(1000, 3)).float()
    expected = reference_statistics(model, samples, batch_size=100)
    calibrate(model, samples, 100)
    assert_matches_reference(model, expected)


def test_a_layer_that_computes_its_own_statistics_is_refused_by_name():
    model = self_stats_net()
    layers, _ = find_batchnorm_layers(model)
    with pytest.raises(UnsupportedLayerError, match=r"BN layer 'bn' of class tests\.nets\.SelfStatsBatchNorm2d") as info:
        probe_call_order(model, layers, torch.randn(2, 3, 7, 6))
    assert "\n" not in str(info.value) and info.value.layer == "bn"


def test_a_layer_that_fails_before_normalising_is_named():
    class Crashing(nn.BatchNorm1d):
        def forward(self, x):
            if self.training:
                raise RuntimeError("Default process group has not been initialized")
            return super().forward(x)

    model = nn.Sequential(nn.BatchNorm1d(3), Crashing(3))
    layers, _ = find_batchnorm_layers(model)
    with pytest.raises(UnsupportedLayerError, match=r"'1' of class .*Crashing.*process group has not been"):
        probe_call_order(model, layers, torch.randn(2, 3))


def test_probe_leaves_the_model_untouched():
    model = perturbed(subclass_net(timm_act=True)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers, _ = find_batchnorm_layers(model)
    order = probe_call_order(model, layers, torch.randn(2, 3, 7, 6))
    assert [layers[i].name for i in order] == ["bn", "shared", "shared", "bn_act"]
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not any(m.training for m in model.modules())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sync", "local"])
def test_cuda_kernels_give_the_reference_statistics(mode):
    """On CUDA the same interception runs torch's CUDA statistics and normalisation kernels."""
    torch.manual_seed(0)
    model = perturbed(subclass_net())
    samples = torch.randn(22, 3, 7, 6) * 1.3 + 0.4
    expected = reference_statistics(model, samples, batch_size=8, mode=mode)
    cuda_model = model.cuda()
    layers, _ = find_batchnorm_layers(cuda_model)
    batches = [samples[s : s + 8] for s in range(0, len(samples), 8)]
    result = calibration_pass(
        cuda_model, layers, batches, mode=mode, collective=SingleProcessCollective(), device="cuda"
    )
    apply_statistics(layers, result.stats, result.steps)
    assert_matches_reference(cuda_model.cpu(), expected)


@pytest.mark.gpu
def test_cuda_ranks_compute_in_full_float32_whatever_the_caller_set(monkeypatch):
    """torch lets cuDNN run float32 convolutions in TF32 by default (0.4% off resnet50's
    variances on an H200): the pass turns it off, so a CUDA rank's statistics are the CPU's,
    and puts the caller's setting back."""
    import torchvision

    torch.manual_seed(0)
    model = perturbed(torchvision.models.resnet18(num_classes=10)).eval()
    samples = torch.randn(16, 3, 64, 64) * 0.7 + 0.2
    expected = reference_statistics(model, samples, batch_size=8)
    float32 = reference_statistics(model, samples, batch_size=8, dtype=torch.float32)
    monkeypatch.setattr(torch.backends.cudnn.conv, "fp32_precision", "tf32")  # torch's default, put back after
    cuda_model = model.cuda()
    layers, _ = find_batchnorm_layers(cuda_model)
    result = calibration_pass(cuda_model, layers, [samples[:8], samples[8:]], mode="sync",
                              collective=SingleProcessCollective(), device="cuda")
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    apply_statistics(layers, result.stats, result.steps)
    assert_matches_reference(cuda_model.cpu(), expected, float32_reference=float32)


def test_full_float32_sets_and_puts_back_the_precision_flags():
    """The flags are settings, readable without a GPU: set for a CUDA pass, put back after
    (also when the pass fails), untouched for a CPU one."""
    from bnrecal.workers.engine.statistics_pass import full_float32

    conv, matmul = torch.backends.cudnn.conv, torch.backends.cuda.matmul
    before = conv.fp32_precision, matmul.fp32_precision
    with full_float32("cpu"):
        assert (conv.fp32_precision, matmul.fp32_precision) == before
    with pytest.raises(RuntimeError, match="boom"), full_float32("cuda:0"):
        assert (conv.fp32_precision, matmul.fp32_precision) == ("ieee", "ieee")
        raise RuntimeError("boom")
    assert (conv.fp32_precision, matmul.fp32_precision) == before


@pytest.mark.parametrize(
    "shape", [(32, 16, 112, 112), (5, 6, 224, 224), (65536, 8)], ids=["cl-large-batch", "cl-large-image", "2d-long"]
)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_statistics_are_exact_in_every_layout(shape, device):
    """torch's channels-last (and 2-D) statistics kernel on the CPU sums a channel's values
    one by one in float32: about 1e-4 off at these sizes. The engine's measurement must not
    be, on the CPU (in chunks) or on CUDA (one call: its kernel merges Welford sums in a tree)."""
    from bnrecal.workers.engine.moments import batch_moments

    generator = torch.Generator().manual_seed(0)
    x = (torch.rand(shape, generator=generator) * 2 + 3).to(device)  # mean 4, std 0.58
    if x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    dims = (0, 2, 3) if x.dim() == 4 else (0,)
    truth = x.double()
    mean, var = truth.mean(dims), truth.var(dims, unbiased=False)
    got = batch_moments(x)
    assert got.mean.device == x.device
    assert ((got.mean - mean).abs() / var.sqrt()).max() < 1e-5
    assert ((got.var - var).abs() / var).max() < 1e-5
