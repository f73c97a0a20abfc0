"""``bnrecal.recalibrate(..., server=URL)`` against a live ``bnrecal serve`` (real uvicorn on
the session's Ray): the model goes as a program, the data as ``.npy``, and the server's
statistics come back into the live model: the same as the Ray path's and the reference's."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import bnrecal
from tests.api.conftest import KEYS, live_server  # noqa: F401 - the server fixture
from tests.nets import mixed_net, perturbed
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics
from tests.service.live.helpers import assert_only_bn_buffers_changed, state
from tests.service.live.test_run import OwnNet, Records, TwoInputs, feed_record

KEY = KEYS["python"]


def test_dict_batches_with_forward_through_a_server(live_server):  # noqa: F811
    torch.manual_seed(3)
    net = perturbed(OwnNet()).eval()
    images, extra = torch.randn(22, 3, 6, 6) * 2 + 1, torch.randn(22, 2) - 0.5
    expected = reference_statistics(TwoInputs(net), torch.cat([images.flatten(1), extra], 1), 6, world_size=2)
    on_ray = copy.deepcopy(net)
    loader = DataLoader(Records(images, extra), batch_size=6)
    before = state(net)
    report = bnrecal.recalibrate(net, loader, workers=2, forward=feed_record, server=live_server.url, api_key=KEY,
                                 progress=False)
    assert_matches_reference(TwoInputs(net), expected)
    assert_only_bn_buffers_changed(before, net, steps=4)
    assert report["world_size"] == 2 and report["samples"] == 22 and report["model"]["server"] == live_server.url
    bnrecal.recalibrate(on_ray, loader, workers=2, forward=feed_record, progress=False)
    for key, value in on_ray.state_dict().items():
        torch.testing.assert_close(net.state_dict()[key].double(), value.double(), rtol=1e-5, atol=1e-7)


def test_a_tensor_loader_and_a_path_through_a_server(live_server, tmp_path):  # noqa: F811
    torch.manual_seed(4)
    model = perturbed(mixed_net()).eval()
    samples = torch.randn(20, 3, 6, 6) * 1.2
    # A loader keeps its own order; a path is read in the seeded fair order (docs/calibration.md, "Order").
    for data, options, first in (
        (DataLoader(TensorDataset(samples, torch.arange(20)), batch_size=8), {"max_samples": 16}, samples[:16]),
        (str(tmp_path / "x.npy"), {"max_samples": 16, "batch_size": 8}, in_contract_order(samples)[:16]),
    ):
        if isinstance(data, str):
            np.save(data, samples.numpy())
        live = copy.deepcopy(model)
        before = state(live)
        report = bnrecal.recalibrate(live, data, server=live_server.url, api_key=KEY, progress=False, **options)
        assert_matches_reference(live, reference_statistics(model, first, 8))
        assert_only_bn_buffers_changed(before, live, steps=2)
        assert report["samples"] == 16


def test_server_errors_come_back_typed(live_server):  # noqa: F811
    model = perturbed(mixed_net()).eval()
    with pytest.raises(bnrecal.AuthenticationError):
        bnrecal.recalibrate(model, [torch.randn(4, 3, 6, 6)], server=live_server.url, api_key="wrong", progress=False)


def test_a_second_call_with_the_same_model_and_data_sends_nothing_again(live_server, tmp_path):  # noqa: F811
    """The blobs are asked for by digest (HEAD) first: what the server holds is not uploaded."""
    from tests.api.test_cli_submit import uploaded_bytes

    torch.manual_seed(6)
    model = perturbed(mixed_net()).eval()
    path = tmp_path / "calib.npy"
    np.save(path, (torch.randn(24, 3, 6, 6) * 1.3).numpy())
    results = []
    for _ in range(2):
        live = copy.deepcopy(model)
        sent_before = uploaded_bytes(live_server)
        bnrecal.recalibrate(live, str(path), server=live_server.url, api_key=KEY, progress=False, batch_size=8)
        results.append((live, uploaded_bytes(live_server) - sent_before))
    (first, first_sent), (second, second_sent) = results
    assert first_sent >= path.stat().st_size
    assert second_sent == 0
    for key, value in first.state_dict().items():
        torch.testing.assert_close(second.state_dict()[key], value)
