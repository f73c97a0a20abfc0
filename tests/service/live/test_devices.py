"""A live model on a GPU: the driver works on a CPU copy, the ranks compute where asked, and
the statistics land in the model's own buffers, on its device (skipped without CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import bnrecal
from tests.nets import mixed_net, perturbed
from tests.reference import assert_matches_reference, reference_statistics
from tests.service.live.helpers import assert_only_bn_buffers_changed, state

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("ray_cluster")]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_model_on_a_gpu_is_updated_in_place(device):
    torch.manual_seed(0)
    model = perturbed(mixed_net()).eval()
    samples = torch.randn(24, 3, 6, 6) * 1.3
    expected = reference_statistics(model, samples, 6)
    live = copy.deepcopy(model).cuda()
    before = state(live)
    report = bnrecal.recalibrate(live, DataLoader(TensorDataset(samples), batch_size=6), device=device,
                                 progress=False)
    assert all(buffer.is_cuda for buffer in live.buffers())
    assert_only_bn_buffers_changed(before, live, steps=4)
    assert_matches_reference(copy.deepcopy(live).cpu(), expected)
    assert report["device"] == device
