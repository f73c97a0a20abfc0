"""``bnrecal.RecalibrationOptions``: every option of a recalibration in one typed object,
taken by ``recalibrate`` and ``recalibrate_many``, with keywords beside it overriding its
fields; the same fields as the job spec and the command line (one declaration)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import bnrecal
from bnrecal.errors import SpecError
from bnrecal.service.jobserver.records.spec import JobSpec
from bnrecal.service.run.options import RunOptions

from tests.nets import mixed_net, perturbed
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics
from tests.shards import photos, write_folder


@pytest.fixture(scope="module")
def model_and_samples() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(7)
    return perturbed(mixed_net()).eval(), torch.randn(96, 3, 6, 5) * 1.4 + 0.2


def buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value for key, value in model.state_dict().items() if "running" in key}


def test_an_options_object_is_the_same_call_as_its_keywords(model_and_samples, tmp_path):
    model, samples = model_and_samples
    np.save(tmp_path / "x.npy", samples.numpy())
    options = bnrecal.RecalibrationOptions(batch_size=16, max_samples=48, order="shuffled", seed=3)
    by_object, by_keywords = copy.deepcopy(model), copy.deepcopy(model)
    report = bnrecal.recalibrate(by_object, str(tmp_path / "x.npy"), options, progress=False)
    bnrecal.recalibrate(by_keywords, str(tmp_path / "x.npy"), batch_size=16, max_samples=48, seed=3, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(buffers(by_object).values(), buffers(by_keywords).values()))
    assert (report["samples"], report["batch_size"], report["seed"]) == (48, 16, 3)
    order = in_contract_order(samples, seed=3)
    assert_matches_reference(by_object, reference_statistics(model, order[:48], 16))


def test_keywords_beside_the_object_override_its_fields_and_leave_it_as_it_was(model_and_samples):
    model, samples = model_and_samples
    options = bnrecal.RecalibrationOptions(batch_size=16, max_samples=64)
    live = copy.deepcopy(model)
    report = bnrecal.recalibrate(live, samples, options, max_samples=32, batch_size=8, progress=False)
    assert (report["samples"], report["steps"]) == (32, 4)
    assert (options.max_samples, options.batch_size) == (64, 16)  # the caller's object is not changed
    assert_matches_reference(live, reference_statistics(model, samples[:32], 8))


def test_a_loaders_own_batches_stay_the_steps_when_the_object_leaves_batch_size_unset(model_and_samples):
    model, samples = model_and_samples
    live = copy.deepcopy(model)
    loader = DataLoader(TensorDataset(samples), batch_size=12)
    report = bnrecal.recalibrate(live, loader, bnrecal.RecalibrationOptions(mode="sync"), progress=False)
    assert (report["batch_size"], report["steps"]) == (12, 8)
    with pytest.raises(SpecError, match="batch_size goes with a Dataset"):  # set on purpose: refused, as a keyword is
        bnrecal.recalibrate(copy.deepcopy(model), loader, bnrecal.RecalibrationOptions(batch_size=12))


@pytest.mark.parametrize(("call", "match", "error"), [
    (lambda m, s: bnrecal.recalibrate(m, s, batch_size=8, wrokers=2), r"unexpected keyword argument 'wrokers'", TypeError),
    (lambda m, s: bnrecal.recalibrate(m, s, {"batch_size": 8}), r"options must be a bnrecal.RecalibrationOptions", TypeError),
    (lambda m, s: bnrecal.recalibrate(m, s, batch_size=8, label_column="y"), r"label_column .* evaluation data", SpecError),
    (lambda m, s: bnrecal.recalibrate(m, s, batch_size=8, transform={"crop": 4}), r"transform says how images", SpecError),
    (lambda m, s: bnrecal.recalibrate(m, s, batch_size=8, workers=True), r"workers must be an integer", SpecError),
    (lambda m, s: bnrecal.recalibrate(m, s, batch_size=8, tolerance=0.1), r"tolerance applies only with", SpecError),
    (lambda m, s: list(bnrecal.recalibrate_many([m], s, batch_size=8, sede=1)), r"recalibrate_many\(\) got an unexpected", TypeError),
], ids=["unknown keyword", "not the options type", "label_column", "transform of tensors", "bool count", "tolerance without auto", "many: unknown keyword"])
def test_a_bad_option_is_refused_before_any_work_naming_it(model_and_samples, call, match, error):
    model, samples = model_and_samples
    live = copy.deepcopy(model)
    with pytest.raises(error, match=match):
        call(live, samples)
    assert all(torch.equal(a, b) for a, b in zip(buffers(live).values(), buffers(model).values()))


def test_images_given_as_a_path_are_read_with_the_options_transform(model_and_samples, tmp_path):
    model, _ = model_and_samples
    folder = write_folder(tmp_path / "photos", photos(12, size=48))
    report = bnrecal.recalibrate(copy.deepcopy(model), str(folder), batch_size=4, transform={"resize": 40, "crop": 32},
                                 progress=False)
    assert report["data"]["sample_shape"] == [3, 32, 32] and report["data"]["transform"]["crop"] == 32


def test_recalibrate_many_takes_the_same_object(model_and_samples):
    model, samples = model_and_samples
    options = bnrecal.RecalibrationOptions(batch_size=16, max_samples=48)
    single, swept = copy.deepcopy(model), copy.deepcopy(model)
    bnrecal.recalibrate(single, samples, options, progress=False)
    (cell,) = bnrecal.recalibrate_many([swept], samples, options)
    assert cell.ok and cell.report["samples"] == 48
    assert all(torch.equal(a, b) for a, b in zip(buffers(single).values(), buffers(swept).values()))


def test_each_option_is_declared_once_for_every_surface():
    """The job spec (HTTP) and the run options (command line) are the recalibration options
    and the model: the same fields, types, defaults and help, declared in one place."""
    shared = bnrecal.RecalibrationOptions.model_fields
    for surface in (RunOptions, JobSpec):
        assert set(shared) <= set(surface.model_fields)
        for name, field in shared.items():
            assert repr(surface.model_fields[name]) == repr(field), (surface.__name__, name)
    options = bnrecal.RecalibrationOptions(workers=2, max_samples="auto", tolerance=0.1, transform={"crop": 224})
    assert bnrecal.RecalibrationOptions.model_validate_json(options.model_dump_json()) == options
    assert options.explicit() == {"workers": 2, "max_samples": "auto", "tolerance": 0.1, "transform": {"crop": 224}}
