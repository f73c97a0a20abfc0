"""torch.export programs recalibrated end to end on the real local Ray cluster: a model
whose class exists only in this test module, exported with a static batch of 1, calibrated
by 2 ranks at batch 8 to its eager model's float64 statistics; the recalibrated program
and its folded ONNX."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from bnrecal.errors import NoBatchNormError, ProgramError, SpecError

from bnrecal.service.run.outputs.exports import export_recalibrated
from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import save_array
from tests.nets import perturbed
from tests.programs import buffers_as_modules, export_program
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics
from tests.service.export.helpers import assert_matches_torch

pytestmark = pytest.mark.usefixtures("ray_cluster")


class OwnNet(nn.Module):
    """A team's own model: nowhere on the server, the ranks or in an allowlist."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 12, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(12), nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(12, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, torch.Tensor, Path, Path]:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("own")
    model = perturbed(OwnNet()).eval()
    samples = torch.randn(27, 3, 10, 10) * 1.3 + 0.2
    program = export_program(model, torch.randn(1, 3, 10, 10), folder / "own.pt2")  # the common static batch of 1
    return model, samples, program, save_array(folder / "x.npy", samples)


def run(settings, program, data, pool=None, **options):
    return recalibrate(RecalibrationRequest(program=program, data=data, **options), settings, pool=pool)


@pytest.mark.parametrize("mode", ["sync", "local"])
def test_a_static_program_gets_its_eager_models_statistics_on_two_ranks(own, settings, mode, warm_pool):
    model, samples, program, data = own
    expected = reference_statistics(model, in_contract_order(samples), batch_size=8, world_size=2, mode=mode)
    result = run(settings, program, data, warm_pool, workers=2, batch_size=8, mode=mode)
    assert_matches_reference(buffers_as_modules(result.model), expected)
    report = result.report
    assert report["arch"] is None and report["program"].to_dict() == {"name": "own.pt2", "batch": "a static batch of 1"}
    assert [layer["name"] for layer in report["layers"]] == ["features.1", "features.4"]
    assert report["collectives"] == (2 * 4 if mode == "sync" else 1)


def test_sync_results_do_not_depend_on_the_world_size_or_the_transport(own, settings, warm_pool):
    _, _, program, data = own
    shipped = settings.model_copy(update={"data_transport": "object_store"})
    results = [run(settings, program, data, warm_pool, workers=1, batch_size=8),
               run(shipped, program, data, warm_pool, workers=2, batch_size=8)]
    assert results[1].report["data_transport"] == "object_store" and results[1].report["object_store_bytes"] > 0
    for key, value in results[0].updates.items():
        torch.testing.assert_close(results[1].updates[key].double(), value.double(), rtol=1e-5, atol=1e-7)


def test_the_recalibrated_program_and_its_folded_onnx(own, settings, tmp_path, warm_pool):
    model, samples, program, data = own
    result = run(settings, program, data, warm_pool, workers=2, batch_size=8)
    out = tmp_path / "out.pt2"
    result.save_model(out)
    loaded = torch.export.load(out)  # torch's own loader takes it, and it runs
    eager = perturbed(OwnNet()).eval()
    eager.load_state_dict(loaded.state_dict)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module()(samples[:1]), eager(samples[:1]), rtol=1e-5, atol=1e-5)
    original = torch.export.load(program).state_dict
    for key, value in original.items():  # every other tensor unchanged
        if key not in result.updates:
            assert torch.equal(loaded.state_dict[key], value), key
    section = export_recalibrated(result, tmp_path / "model.onnx")
    assert section["folded"] == 2 and section["batchnorm_nodes"] == 0 and section["batch"] == 1
    assert_matches_torch(tmp_path / "model.onnx", eager, samples[:1])


def test_evaluation_runs_on_a_program(own, settings, tmp_path, warm_pool):
    model, samples, program, data = own
    labels = np.arange(len(samples)) % 5
    np.savez(tmp_path / "eval.npz", x=samples.numpy(), y=labels)
    result = run(settings, program, data, warm_pool, workers=2, batch_size=8, eval_data=tmp_path / "eval.npz")
    evaluation = result.report["evaluation"]
    assert evaluation["samples"] == 27 and evaluation["labelled"] and "top1" in evaluation["after"]


def test_requests_name_one_model(own, settings, tmp_path):
    _, _, program, data = own
    with pytest.raises(SpecError, match="arch does not go with program"):
        RecalibrationRequest(program=program, arch="torchvision:resnet18", data=data)
    with pytest.raises(SpecError, match=r"give program \(a torch.export .pt2\), or arch with checkpoint"):
        RecalibrationRequest(data=data)


def test_a_program_without_bn_is_refused(settings, tmp_path):
    program = export_program(nn.Sequential(nn.Flatten(), nn.Linear(12, 2)), torch.randn(1, 3, 2, 2), tmp_path / "p.pt2")
    data = save_array(tmp_path / "x.npy", torch.randn(4, 3, 2, 2))
    with pytest.raises(NoBatchNormError, match=r"program 'p.pt2' has no BatchNorm layer"):
        run(settings, program, data)


def test_a_program_refuses_data_of_another_shape(own, settings, tmp_path):
    _, _, program, _ = own
    data = save_array(tmp_path / "x.npy", torch.randn(4, 3, 12, 12))
    with pytest.raises(Exception, match=r"takes 'x' samples of shape \(3, 10, 10\), got \(3, 12, 12\)"):
        run(settings, program, data)


def test_a_file_that_is_no_program_is_refused(settings, tmp_path):
    fake = tmp_path / "model.pt2"
    torch.save({"w": torch.zeros(2)}, fake)
    with pytest.raises(ProgramError, match=r"program 'model.pt2'"):
        run(settings, fake, save_array(tmp_path / "x.npy", torch.randn(4, 3)))
