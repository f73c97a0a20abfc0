"""The CUDA path: NCCL collective, one GPU per rank, moments still in float64."""

from __future__ import annotations

import pytest
import torch

from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import save_array, save_state
from tests.nets import mixed_net, perturbed
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("ray_cluster")]


@pytest.mark.parametrize("workers", [1, 2])
def test_cuda_ranks_match_the_reference(settings, tmp_path, workers):
    if torch.cuda.device_count() < workers:
        pytest.skip(f"needs {workers} CUDA devices")
    torch.manual_seed(2)
    model = perturbed(mixed_net())
    samples = torch.randn(22, 3, 6, 5)
    request = RecalibrationRequest(
        arch="tests.nets:mixed_net", checkpoint=save_state(tmp_path / "m.pt", model),
        data=save_array(tmp_path / "x.npy", samples.numpy()), workers=workers, batch_size=8, device="cuda",
    )
    result = recalibrate(request, settings)
    assert result.report["backend"] == "nccl" and result.report["device"] == "cuda"
    assert_matches_reference(result.model.cpu(), reference_statistics(model, in_contract_order(samples), 8))
