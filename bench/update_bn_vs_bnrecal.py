"""How far ``torch.optim.swa_utils.update_bn`` and ``bnrecal.recalibrate`` land from the
exact statistics, on the same model and loader.

A small conv net (Conv -> BN -> ReLU -> Dropout(0.3) -> Conv -> BN) with random weights,
512 samples of 3x8x8 whose mean drifts from -2 to 2 along the dataset, batches of 32:
in dataset order (``--order sorted``, as a loader without shuffling over ordered data
reads them) or shuffled. The exact statistics are the float64 reference of the test
suite (``tests/reference.py``: every value each BN layer sees, dropout off). Printed per
layer: the largest relative error of ``running_var`` and the largest error of
``running_mean`` in units of the true std, for each of the two.

    PYTHONPATH=. .venv/bin/python bench/update_bn_vs_bnrecal.py [--order sorted|shuffled] [--workers 2]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn
from torch.optim.swa_utils import update_bn
from torch.utils.data import DataLoader, TensorDataset

import bnrecal
from tests.reference import reference_statistics


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.3)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(self.drop(torch.relu(self.bn1(self.conv1(x))))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", choices=["sorted", "shuffled"], default="sorted")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(512, 3, 8, 8) + torch.linspace(-2, 2, 512)[:, None, None, None]
    if args.order == "shuffled":
        x = x[torch.randperm(512, generator=torch.Generator().manual_seed(1))]
    loader = DataLoader(TensorDataset(x), batch_size=32)
    exact = reference_statistics(model, x, 32)
    swa = copy.deepcopy(model)
    update_bn(loader, swa)
    ours = copy.deepcopy(model)
    bnrecal.recalibrate(ours, loader, workers=args.workers, progress=False)
    print("| layer | order | method | running_var max rel. error | running_mean max error (std) |")
    print("|---|---|---|---|---|")
    for name, (mean, var) in exact.items():
        for label, result in (("update_bn", swa), ("bnrecal", ours)):
            layer = result.get_submodule(name)
            var_err = ((layer.running_var.double() - var).abs() / var).max().item()
            mean_err = ((layer.running_mean.double() - mean).abs() / var.sqrt()).max().item()
            print(f"| {name} | {args.order} | {label} | {var_err:.3g} | {mean_err:.3g} |")


if __name__ == "__main__":
    main()
