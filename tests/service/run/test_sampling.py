"""Fair order, standard errors and ``max_samples: "auto"`` on a real local Ray cluster
(docs/calibration.md, "Order" and "How many samples"): the seeded order gives the
reference's statistics at any K, the standard errors are the same at any K in sync mode, and
every rank stops at the same step once every layer is within the tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bnrecal.errors import SpecError

from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import save_array, save_state
from tests.nets import mixed_net, perturbed
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.Tensor, Path, Path]:
    torch.manual_seed(1)
    folder = tmp_path_factory.mktemp("sampling")
    model = perturbed(mixed_net())
    # In "class order": the first half of the file is shifted, as when folders are read class by class.
    samples = torch.cat([torch.randn(600, 3, 6, 5) + 1.0, torch.randn(600, 3, 6, 5) - 1.0])
    return model, samples, save_state(folder / "model.pt", model), save_array(folder / "x.npy", samples)


def run(settings, checkpoint, data, pool, **options):
    request = RecalibrationRequest(arch="tests.nets:mixed_net", checkpoint=checkpoint, data=data, **options)
    return recalibrate(request, settings, pool=pool)


def test_shuffled_order_matches_the_reference_and_agrees_for_1_2_and_4_ranks(mixed, settings, warm_pool):
    model, samples, checkpoint, data = mixed
    expected = reference_statistics(model, in_contract_order(samples, seed=3)[:240], batch_size=16)
    results = {
        k: run(settings, checkpoint, data, warm_pool, workers=k, batch_size=16, max_samples=240, seed=3)
        for k in (1, 2, 4)
    }
    for result in results.values():
        assert_matches_reference(result.model, expected)
        assert (result.report["order"], result.report["seed"]) == ("shuffled", 3)
    base = results[1]
    for k in (2, 4):
        for key, value in results[k].updates.items():
            torch.testing.assert_close(value.double(), base.updates[key].double(), rtol=1e-5, atol=1e-7)
        for mine, theirs in zip(results[k].report["layers"], base.report["layers"]):  # from the same global moments
            for field in ("se_mean_max", "se_mean_median", "se_var_max", "se_var_median"):
                assert mine[field] == pytest.approx(theirs[field], rel=1e-4)
    assert all(layer["se_var_max"] > 0 for layer in base.report["layers"])


def test_given_order_keeps_the_file_order(mixed, settings, warm_pool):
    model, samples, checkpoint, data = mixed
    result = run(settings, checkpoint, data, warm_pool, workers=2, batch_size=16, max_samples=240, order="given")
    assert_matches_reference(result.model, reference_statistics(model, samples[:240], batch_size=16))
    assert (result.report["order"], result.report["seed"]) == ("given", None)
    # Its first 240 samples come from one "class" only: its statistics are far from the fair draw's.
    fair = run(settings, checkpoint, data, warm_pool, workers=2, batch_size=16, max_samples=240)
    first = next(iter(result.updates))
    assert not torch.allclose(result.updates[first], fair.updates[first], atol=0.1)


def test_auto_stops_every_rank_at_the_same_step_once_every_layer_is_within_tolerance(mixed, settings, warm_pool):
    model, samples, checkpoint, data = mixed
    reports = {
        k: run(settings, checkpoint, data, warm_pool, workers=k, batch_size=16, max_samples="auto", tolerance=0.05).report
        for k in (1, 3)
    }
    for report in reports.values():
        convergence = report["convergence"]
        assert convergence["converged"] and convergence["tolerance"] == 0.05
        assert report["samples"] < len(samples) and convergence["available_samples"] == len(samples)
        assert report["samples"] == convergence["samples"] == report["steps"] * 16
        assert len(set(report["collectives_per_rank"])) == 1  # every rank made the same collectives: stopped together
        for layer in report["layers"]:
            assert layer["se_mean_max"] <= 0.05 and layer["se_var_max"] <= 0.05
        worst = convergence["worst"]
        assert worst == report["standard_error_max"] and worst["error"] <= 0.05
    assert reports[1]["steps"] == reports[3]["steps"]  # the decision comes from the global numbers


def test_auto_on_too_little_data_uses_all_of_it_and_says_it_did_not_converge(mixed, settings, warm_pool):
    _, samples, checkpoint, data = mixed
    report = run(settings, checkpoint, data, warm_pool, workers=2, batch_size=16, max_samples="auto", tolerance=0.001).report
    assert report["samples"] == len(samples) and not report["convergence"]["converged"]
    assert report["convergence"]["worst"]["error"] > 0.001


def test_auto_in_local_mode_is_refused_naming_the_field(mixed):
    _, _, checkpoint, data = mixed
    with pytest.raises(SpecError, match="needs mode sync") as caught:
        RecalibrationRequest.checked(
            arch="tests.nets:mixed_net", checkpoint=checkpoint, data=data, mode="local", max_samples="auto"
        )
    assert caught.value.field == "max_samples"


@pytest.mark.parametrize("workers", [1, 2])
def test_int8_ranges_come_from_the_samples_auto_calibrated_on(mixed, settings, warm_pool, tmp_path, workers):
    """docs/int8.md, "How the ranges are gathered": the INT8 ranges are gathered over the
    samples the statistics came from. With "auto" that is the converged prefix of the order,
    so the file is the one a run told that many samples writes, and not the one over all the
    data."""
    from bnrecal.service.export.int8.options import Int8Options
    from bnrecal.service.run.outputs.later_phases import RunOutputs

    _, samples, checkpoint, data = mixed
    options = dict(workers=workers, batch_size=16, seed=2)
    in_process = {"in_process": True} if workers == 1 else {}

    def int8(max_samples, name):
        request = RecalibrationRequest(
            arch="tests.nets:mixed_net", checkpoint=checkpoint, data=data, max_samples=max_samples, **options
        )
        outputs = RunOutputs(int8=tmp_path / name, int8_options=Int8Options())
        result = recalibrate(request, settings, pool=warm_pool, outputs=outputs, **in_process)
        return result.report, result.report.int8, (tmp_path / name).read_bytes()

    auto, auto_section, auto_file = int8("auto", "auto.onnx")
    converged = auto["samples"]
    assert auto["convergence"]["converged"] and converged < len(samples)
    assert auto_section["samples"] == converged
    fixed, _, fixed_file = int8(converged, "fixed.onnx")
    assert fixed["samples"] == converged
    assert auto_file == fixed_file
    _, everything_section, everything_file = int8(len(samples), "all.onnx")
    assert everything_section["samples"] == len(samples) and everything_file != auto_file
