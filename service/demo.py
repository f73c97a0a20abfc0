"""Inputs for the quick-start demo: a model with stale BN statistics and real images.

``python -m service.demo DIR`` writes ``DIR/resnet18-stale.pt`` (a torchvision resnet18
whose BN running statistics are the untouched defaults, as after weight averaging) and
``DIR/digits.npy`` (scikit-learn's handwritten digits, upscaled to 3x64x64), so a new
user can run a real recalibration with nothing downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torchvision


def write_demo_inputs(folder: Path, samples: int = 256) -> tuple[Path, Path]:
    """Write the demo checkpoint and calibration array into ``folder``; return their paths."""
    from sklearn.datasets import load_digits

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    checkpoint = folder / "resnet18-stale.pt"
    torch.save({"model": model.state_dict(), "epoch": 90}, checkpoint)
    images = torch.from_numpy(load_digits().images[:samples].astype(np.float32) / 16.0)
    images = torch.nn.functional.interpolate(images[:, None], size=(64, 64), mode="bilinear", align_corners=False)
    data = folder / "digits.npy"
    np.save(data, images.repeat(1, 3, 1, 1).numpy())
    return checkpoint, data


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "demo")
    for path in write_demo_inputs(target):
        print(path)
