"""The standard errors of the recalibrated statistics are honest (docs/calibration.md, "How
many samples"), and a pass with a stop rule ends at the first step where they are all within
the tolerance.

The model's BN inputs are linear in the data (a convolution, and a 1x1 convolution beside
it), so their true statistics are those of a large reference population pushed through the
same convolutions in float64. A calibration on a random subset estimates them; its error
must lie within 2 standard errors for about 95% of the channels (and within 1 for about 68%:
the error bars are neither too narrow nor too wide), and the error bars must shrink like
1/sqrt(samples)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from bnrecal.workers.engine.batchnorm import find_batchnorm_layers
from bnrecal.workers.engine.statistics_pass import StopRule, calibration_pass
from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.workers.engine.moments import accumulate_errors, error_size, pack, batch_moments, standard_errors

BATCH = 32


class TwoLinearBranches(nn.Module):
    """Two BN layers whose inputs are linear in the data."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(6, 24, 3, padding=1)
        self.bn = nn.BatchNorm2d(24)
        self.pointwise = nn.Conv2d(6, 16, 1)
        self.bn_pointwise = nn.BatchNorm2d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).mean((2, 3))[:, :16] + self.bn_pointwise(self.pointwise(x)).mean((2, 3))


@pytest.fixture(scope="module")
def population() -> torch.Tensor:
    """Skewed, spatially correlated images: a per-sample offset per channel (so the values
    of one image are not independent), gamma noise, and a random gain per sample."""
    rng = np.random.default_rng(1)
    n = 30_000
    offset = rng.gamma(2.0, 1.0, size=(n, 6, 1, 1))
    noise = rng.gamma(1.5, 1.0, size=(n, 6, 8, 8)) * rng.choice([0.5, 2.0], size=(n, 1, 1, 1))
    return torch.from_numpy((offset + noise).astype(np.float32))


@pytest.fixture(scope="module")
def model() -> TwoLinearBranches:
    torch.manual_seed(0)
    return TwoLinearBranches().eval()


@pytest.fixture(scope="module")
def truth(model: TwoLinearBranches, population: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each BN layer's true input mean and variance over the population, in float64."""
    reference = {}
    x = population.double()
    with torch.no_grad():
        for name, conv in (("bn", model.conv), ("bn_pointwise", model.pointwise)):
            y = nn.functional.conv2d(x, conv.weight.double(), conv.bias.double(), padding=conv.padding)
            reference[name] = (y.mean((0, 2, 3)), y.var((0, 2, 3), unbiased=False))
    return reference


def calibrate(model: nn.Module, samples: torch.Tensor, **options):
    layers, _ = find_batchnorm_layers(model)
    batches = (samples[start : start + BATCH] for start in range(0, len(samples), BATCH))
    result = calibration_pass(model, layers, batches, mode="sync", collective=SingleProcessCollective(), **options)
    return {layer.name: stat for layer, stat in zip(layers, result.stats)}, result


def errors_in_standard_errors(
    stats: dict, truth: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """|estimate - truth| / standard error, per channel of every layer, for the mean and the variance."""
    mean_z, var_z = [], []
    for name, (true_mean, true_var) in truth.items():
        stat = stats[name]
        mean_z.append((stat.mean - true_mean).abs() / true_var.sqrt() / stat.se_mean)
        var_z.append((stat.var / true_var - 1).abs() / stat.se_var)
    return torch.cat(mean_z), torch.cat(var_z)


def test_true_errors_lie_within_two_standard_errors_for_about_95_percent_of_channels(
    model: TwoLinearBranches, population: torch.Tensor, truth: dict
) -> None:
    mean_z, var_z = [], []
    for seed in range(20):  # 20 independent random subsets of 640 samples (20 steps each)
        draw = torch.from_numpy(np.random.default_rng(100 + seed).permutation(len(population))[:640])
        stats, _ = calibrate(model, population[draw])
        m, v = errors_in_standard_errors(stats, truth)
        mean_z.append(m)
        var_z.append(v)
    for z in (torch.cat(mean_z), torch.cat(var_z)):
        within_two = (z <= 2).double().mean().item()
        within_one = (z <= 1).double().mean().item()
        assert within_two >= 0.90, f"only {within_two:.1%} of channels within 2 standard errors"
        assert 0.55 <= within_one <= 0.85, f"{within_one:.1%} within 1 standard error (honest: about 68%)"


def test_standard_errors_shrink_like_one_over_the_square_root_of_the_samples(
    model: TwoLinearBranches, population: torch.Tensor
) -> None:
    def average(count: int) -> dict[str, dict[str, torch.Tensor]]:
        """Each layer's standard errors per channel, averaged over 10 random subsets of ``count``
        (one subset's own estimate is uncertain by about 1/sqrt(2 x steps))."""
        runs = []
        for seed in range(10):
            draw = torch.from_numpy(np.random.default_rng(200 + seed).permutation(len(population))[:count])
            runs.append(calibrate(model, population[draw])[0])
        return {
            name: {kind: torch.stack([getattr(run[name], kind) for run in runs]).mean(0) for kind in ("se_mean", "se_var")}
            for name in runs[0]
        }

    small, large = average(512), average(4096)
    for name in small:
        for kind in ("se_mean", "se_var"):
            ratio = (small[name][kind] / large[name][kind]).median().item()
            assert ratio == pytest.approx(8**0.5, rel=0.15), f"{name} {kind}: 8x the samples shrank it {ratio:.2f}x"


def test_standard_errors_follow_the_cluster_formula_written_out() -> None:
    """For one layer, the packed sums give the textbook ratio-estimator variance of each step's mean."""
    torch.manual_seed(3)
    steps = [torch.randn(n, 4, 3, 3) * 2 + 1 for n in (8, 8, 8, 5)]
    shift = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64)
    total = torch.zeros(9, dtype=torch.float64)
    sums = torch.zeros(error_size(4), dtype=torch.float64)
    for x in steps:
        packed = pack(batch_moments(x), shift, torch.empty(9, dtype=torch.float64))
        total += packed
        accumulate_errors(packed, sums)
    se_mean, se_var = standard_errors(total, sums)
    values = [x.double().transpose(0, 1).reshape(4, -1) for x in steps]
    n = torch.tensor([v.shape[1] for v in values], dtype=torch.float64)
    means = torch.stack([v.mean(1) for v in values])  # steps x channels
    second = torch.stack([(v**2).mean(1) for v in values])
    N, J = n.sum(), len(values)
    a = (n[:, None] * means).sum(0) / N
    b = (n[:, None] * second).sum(0) / N
    var = b - a * a
    mean_var = J / (J - 1) * ((n[:, None] * (means - a)) ** 2).sum(0) / N**2
    e = n[:, None] * (second - b - 2 * a * (means - a))
    var_var = J / (J - 1) * (e**2).sum(0) / N**2
    torch.testing.assert_close(se_mean, mean_var.sqrt() / var.sqrt(), rtol=1e-6, atol=0)  # the batch kernel runs in float32
    torch.testing.assert_close(se_var, var_var.sqrt() / var, rtol=1e-6, atol=0)  # the batch kernel runs in float32


def test_a_stop_rule_ends_at_the_first_step_within_tolerance(model: TwoLinearBranches, population: torch.Tensor) -> None:
    samples = population[:3200]
    stats, result = calibrate(model, samples, stop=StopRule(tolerance=0.03))
    assert result.convergence is not None and result.convergence.converged
    assert 16 <= result.steps < 100 and result.samples == result.steps * BATCH
    worst = max(max(s.se_mean.max().item(), s.se_var.max().item()) for s in stats.values())
    assert worst <= 0.03 and result.convergence.error == pytest.approx(worst)
    before, _ = calibrate(model, samples[: (result.steps - 1) * BATCH])  # one step less: not yet within it
    assert max(max(s.se_mean.max().item(), s.se_var.max().item()) for s in before.values()) > 0.03 or result.steps == 16


def test_data_that_runs_out_first_is_reported_as_not_converged(model: TwoLinearBranches, population: torch.Tensor) -> None:
    _, result = calibrate(model, population[:640], stop=StopRule(tolerance=0.001))
    assert result.steps == 20 and not result.convergence.converged
    assert result.convergence.error > 0.001 and result.convergence.statistic in ("mean", "variance")
    _, short = calibrate(model, population[:320], stop=StopRule(tolerance=0.5))  # 10 steps < the minimum
    assert not short.convergence.converged


def test_a_stop_rule_needs_sync_mode(model: TwoLinearBranches, population: torch.Tensor) -> None:
    layers, _ = find_batchnorm_layers(model)
    with pytest.raises(ValueError, match="sync mode"):
        calibration_pass(model, layers, [population[:8]], mode="local", collective=SingleProcessCollective(),
                         stop=StopRule(0.01))


def test_a_non_finite_sample_in_a_shuffled_order_is_named_by_its_row_in_the_file(model: TwoLinearBranches) -> None:
    rows = np.random.default_rng(0).permutation(40)
    data = torch.randn(40, 6, 8, 8)
    data[int(rows[13])] = float("nan")  # the file's row that lands at position 13 of the order
    layers, _ = find_batchnorm_layers(model)
    shuffled = data[torch.from_numpy(rows)]
    batches = [shuffled[start : start + 8] for start in range(0, 40, 8)]
    with pytest.raises(Exception) as info:
        calibration_pass(model, layers, batches, mode="sync", collective=SingleProcessCollective(),
                         row_of=lambda position: int(rows[position]))
    assert str(info.value) == (
        f"calibration sample {int(rows[13])} has non-finite values (NaN or inf), first seen by BN layer 'bn' "
        "(BatchNorm2d) in step 1 (positions of the shuffled order 8-15): fix or leave out that sample"
    )
