"""The PyTorch-side fold: on the torch.fx dataflow where the model traces, on plain
nn.Sequential neighbours (with call counting) where it does not."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from bnrecal.service.export import export_folded_onnx
from bnrecal.service.export.folding.in_torch import fold_batchnorm_modules
from tests.service.export.helpers import assert_matches_torch, set_batchnorm_statistics


class Traceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.shared, self.bn_shared = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
        self.linear, self.bn_linear = nn.Linear(6, 5), nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        y = self.bn_shared(self.shared(y)) + self.shared(y)
        return self.bn_linear(self.linear(y.flatten(2)[..., :6]))


class NotTraceable(nn.Module):
    """``if x.dim() == 4`` stops torch.fx (a Proxy has no truth value), not torch.export."""

    def __init__(self) -> None:
        super().__init__()
        conv = nn.Conv2d(4, 4, 1)
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1)
        )
        self.twice = nn.Sequential(conv, nn.BatchNorm2d(4), nn.ReLU(), conv)  # one conv module, two calls
        self.tail = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(4))  # Linear on 3-D input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            x = self.twice(self.body(x))
        return self.tail(x.flatten(2)[..., :4])


def test_fx_dataflow_folds_only_legal_pairs() -> None:
    torch.manual_seed(0)
    model = set_batchnorm_statistics(Traceable())
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        expected = model(x)
    result = fold_batchnorm_modules(model, x)
    assert result.method == "fx"
    assert result.folded == ["bn"]
    assert "called at 2 call sites" in result.skipped["bn_shared"]
    assert "3-D" in result.skipped["bn_linear"]
    assert result.rewritten == {"conv.weight": "bn"}
    assert isinstance(model.bn, nn.Identity) and isinstance(model.bn_shared, nn.BatchNorm2d)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_untraceable_model_folds_sequential_neighbours() -> None:
    torch.manual_seed(0)
    model = set_batchnorm_statistics(NotTraceable())
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        expected = model(x)
    result = fold_batchnorm_modules(model, x)
    assert result.method == "modules"
    assert sorted(result.folded) == ["body.1", "body.3"]  # conv -> BN, and BN -> conv without padding
    assert isinstance(model.twice[1], nn.BatchNorm2d) and isinstance(model.tail[1], nn.BatchNorm1d)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_untraceable_model_exports_correctly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = set_batchnorm_statistics(NotTraceable())
    out = tmp_path / "model.onnx"
    report = export_folded_onnx(model, torch.randn(4, 3, 6, 6), out)
    # twice.1 sits between two calls of one conv, tail.1 after a 3-D Linear: both stay
    assert (report["folded"], report["batchnorm_nodes"]) == (2, 2)
    assert sorted(u["name"] for u in report["unfolded"]) == ["tail.1", "twice.1"]
    assert_matches_torch(out, model, torch.randn(3, 3, 6, 6))
