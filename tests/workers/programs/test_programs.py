"""torch.export programs calibrated in one process (no Ray): the same statistics as the
eager model they were exported from, whatever batch they were exported with, in every
form torch.export gives, and clear refusals where a program cannot be calibrated.

The reference is the eager model's own forward in float64 (``tests/reference.py``): the
engine never sees that model, only the program exported from it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bnrecal.workers.engine.batchnorm import find_batchnorm_layers
from bnrecal.workers.engine.statistics_pass import apply_statistics, calibration_pass
from bnrecal.workers.engine.calibrator import probe_call_order
from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.errors import ModelInputError, ProgramError
from bnrecal.workers.programs import load_program, write_archive
from bnrecal.workers.ranks.sharding import rank_ranges

from tests.nets import perturbed
from tests.programs import buffers_as_modules, export_program
from tests.reference import assert_matches_reference, reference_statistics


class TinyResNet(nn.Module):
    """A model class that exists only in this test module: conv, BN, a residual block with a
    BN called twice, a BN after a Linear, and dropout (off in eval)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.twice = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8, 6)
        self.bn1d = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        x = x + torch.relu(self.twice(self.conv(x)))
        x = self.twice(x * 0.5 - 0.25)
        x = self.drop(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return self.head(torch.relu(self.bn1d(self.fc(x))))


def stale_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return perturbed(TinyResNet()).eval()


def calibrate_program(program: nn.Module, samples: torch.Tensor, batch: int, world: int = 1, mode: str = "sync"):
    """Every rank's share of a calibration, run one rank after another in local mode, or as
    one rank in sync mode (world 1): what the ranks compute, without Ray."""
    layers, _ = find_batchnorm_layers(program)
    order = probe_call_order(program, layers, samples[:1])
    ranges = rank_ranges(len(samples), batch, world, 0)
    result = calibration_pass(
        program, layers, [samples[a:b] for a, b in ranges], mode=mode, collective=SingleProcessCollective(),
        call_order=order,
    )
    apply_statistics(layers, result.stats, result.steps)
    return result


@pytest.mark.parametrize(
    ("export_batch", "dynamic", "decompose"),
    [(1, False, False), (3, False, False), (1, False, True), (2, True, False), (2, True, True)],
    ids=["static-1", "static-3-padded", "static-1-decomposed", "dynamic", "dynamic-decomposed"],
)
def test_a_program_gets_the_eager_models_statistics(tmp_path, export_batch, dynamic, decompose):
    model = stale_model()
    samples = torch.randn(21, 3, 6, 5) * 1.5 + 0.3  # steps of 8, 8, 5: chunks of 3 pad the last
    path = export_program(model, samples[:export_batch], tmp_path / "m.pt2", dynamic=dynamic, decompose=decompose)
    program = load_program(path)
    assert program.batch.static is not dynamic
    result = calibrate_program(program, samples, 8)
    expected = reference_statistics(model, samples, batch_size=8)
    assert_matches_reference(buffers_as_modules(program), expected)
    layers = find_batchnorm_layers(program)[0]
    assert [layer.name for layer in layers] == ["bn", "twice", "bn1d"]
    assert result.calls == [3, 6, 3]  # "twice" normalises twice per step
    assert [layer.class_name for layer in layers] == ["BatchNorm2d", "BatchNorm2d", "BatchNorm1d"]


def test_a_program_runs_like_its_model_at_any_batch(tmp_path):
    model = stale_model()
    samples = torch.randn(7, 3, 6, 5)
    program = load_program(export_program(model, samples[:2], tmp_path / "m.pt2"))
    with torch.no_grad():
        torch.testing.assert_close(program(samples), model(samples), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(program(samples[:1]), model(samples[:1]), rtol=1e-5, atol=1e-5)


def test_local_mode_uses_each_slice_alone(tmp_path):
    model = stale_model()
    samples = torch.randn(16, 3, 6, 5) + 0.5
    program = load_program(export_program(model, samples[:1], tmp_path / "m.pt2"))
    layers, _ = find_batchnorm_layers(program)
    # two ranks' slices of each step, as ranks in local mode see them, one after the other
    batches = [samples[a:b] for rank in range(2) for a, b in rank_ranges(16, 8, 2, rank)]
    result = calibration_pass(program, layers, batches, mode="local", collective=SingleProcessCollective())
    apply_statistics(layers, result.stats, result.steps // 2)
    expected = reference_statistics(model, samples, batch_size=8, world_size=2, mode="local")
    assert_matches_reference(buffers_as_modules(program), expected)


def test_the_recalibrated_program_is_the_same_archive_with_new_buffers(tmp_path):
    model = stale_model()
    samples = torch.randn(12, 3, 6, 5)
    source = export_program(model, samples[:1], tmp_path / "m.pt2")
    program = load_program(source)
    calibrate_program(program, samples, 4)
    layers = find_batchnorm_layers(program)[0]
    updates = {key: getattr(layer, role) for layer in layers for role, key in layer.buffer_names().items()}
    assert "bn.num_batches_tracked" in updates
    write_archive(source, updates, tmp_path / "out.pt2")
    before = torch.export.load(source).state_dict
    after = torch.export.load(tmp_path / "out.pt2")
    for key, value in before.items():
        if key in updates:
            assert torch.equal(after.state_dict[key], updates[key]), key
        else:
            assert torch.equal(after.state_dict[key], value), key
    assert after.state_dict["bn.num_batches_tracked"].item() == before["bn.num_batches_tracked"].item() + 3
    with torch.no_grad():  # torch's own loader runs it, with the new statistics
        reference = copy.deepcopy(model)
        reference.load_state_dict(after.state_dict)
        torch.testing.assert_close(after.module()(samples[:1]), reference(samples[:1]), rtol=1e-5, atol=1e-5)


class UntrackedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.free = nn.BatchNorm2d(4, track_running_stats=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.free(self.bn(self.conv(x))).mean((2, 3))


@pytest.mark.parametrize("decompose", [False, True], ids=["batch_norm", "no_stats"])
def test_a_layer_without_running_statistics_is_listed_as_skipped(tmp_path, decompose):
    program = load_program(export_program(UntrackedNet().eval(), torch.randn(2, 3, 4, 4), tmp_path / "m.pt2",
                                          decompose=decompose))
    layers, skipped = find_batchnorm_layers(program)
    assert [layer.name for layer in layers] == ["bn"]
    assert [s.name for s in skipped] == ["free"] and "track_running_stats=False" in skipped[0].reason


class TorchBatchNorm(nn.BatchNorm2d):
    """A subclass that normalises through torch.batch_norm itself, not F.batch_norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.batch_norm(
            x, self.weight, self.bias, self.running_mean, self.running_var, self.training, 0.1, self.eps, False
        ) * 2.0


def test_a_bn_subclass_calling_torch_batch_norm_is_calibrated():
    torch.manual_seed(0)
    model = perturbed(nn.Sequential(nn.Conv2d(3, 4, 3), TorchBatchNorm(4), nn.ReLU(), nn.BatchNorm2d(4))).eval()
    samples = torch.randn(10, 3, 6, 6) + 1.0
    expected = reference_statistics(model, samples, batch_size=4)
    layers, _ = find_batchnorm_layers(model)
    result = calibration_pass(model, layers, [samples[i : i + 4] for i in range(0, 10, 4)], mode="sync",
                              collective=SingleProcessCollective())
    apply_statistics(layers, result.stats, result.steps)
    assert_matches_reference(model, expected)
    assert result.calls == [3, 3]


class ParameterStatistics(nn.Module):
    """Normalises with running statistics that are parameters, not buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Parameter(torch.zeros(3), requires_grad=False)
        self.var = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.mean, self.var)


class ConstantStatistics(nn.Module):
    """Normalises with running statistics that are plain tensor attributes (constants)."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = torch.zeros(3)
        self.var = torch.ones(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.mean, self.var)


@pytest.mark.parametrize(
    ("model", "match"),
    [(ParameterStatistics(), r"node 'batch_norm' normalises with a parameter \(mean\)"),
     (ConstantStatistics(), r"normalises with a constant")],
    ids=["parameters", "constants"],
)
def test_statistics_that_are_not_buffers_are_refused_by_node(tmp_path, model, match):
    path = export_program(model, torch.randn(2, 3), tmp_path / "m.pt2")
    with pytest.raises(ProgramError, match=match) as info:
        load_program(path)
    assert "\n" not in str(info.value)


def test_a_program_without_bn_has_no_layers(tmp_path):
    program = load_program(export_program(nn.Sequential(nn.Linear(3, 2)), torch.randn(1, 3), tmp_path / "m.pt2"))
    assert find_batchnorm_layers(program) == ([], [])


def test_a_program_exported_in_training_mode_is_refused(tmp_path):
    model = stale_model().train()
    program = torch.export.export(model, (torch.randn(2, 3, 6, 5),))
    torch.export.save(program, tmp_path / "m.pt2")
    with pytest.raises(ProgramError, match=r"exported in training mode .*model.eval\(\)"):
        load_program(tmp_path / "m.pt2")


def test_data_of_the_wrong_shape_is_refused_before_any_rank(tmp_path):
    program = load_program(export_program(stale_model(), torch.randn(1, 3, 6, 5), tmp_path / "m.pt2"))
    layers, _ = find_batchnorm_layers(program)
    with pytest.raises(ModelInputError, match=r"takes 'x' samples of shape \(3, 6, 5\), got \(3, 7, 5\)"):
        probe_call_order(program, layers, torch.randn(1, 3, 7, 5))


def test_a_program_copies_with_its_own_buffers(tmp_path):
    program = load_program(export_program(stale_model(), torch.randn(1, 3, 6, 5), tmp_path / "m.pt2"))
    clone = copy.deepcopy(program)
    find_batchnorm_layers(clone)[0][0].running_mean.add_(1.0)
    assert not torch.equal(find_batchnorm_layers(clone)[0][0].running_mean, find_batchnorm_layers(program)[0][0].running_mean)


class TokenNet(nn.Module):
    """BatchNorm1d over every token of every sample (LeViT's LinearNorm): its rows are not
    the samples, so a padded chunk's rows cannot be told apart."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 2, stride=2)
        self.linear = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2)  # (N, L, C)
        normed = self.bn(self.linear(tokens).flatten(0, 1)).reshape_as(tokens)
        return normed.mean(1)


def test_rows_that_are_not_samples_are_exact_without_padding_and_refused_with_it(tmp_path):
    torch.manual_seed(0)
    model = perturbed(TokenNet()).eval()
    samples = torch.randn(12, 3, 4, 4) + 0.5
    single = load_program(export_program(model, samples[:1], tmp_path / "one.pt2"))
    calibrate_program(single, samples, 6)  # chunks of 1: every row is a real sample's
    assert_matches_reference(buffers_as_modules(single), reference_statistics(model, samples, batch_size=6))
    pair = load_program(export_program(model, samples[:2], tmp_path / "two.pt2"))
    with pytest.raises(ModelInputError, match=r"normalises rows that are not its samples .* static batch \(2\)"):
        calibrate_program(pair, samples, 5)  # steps of 5 leave a padded chunk of 2
