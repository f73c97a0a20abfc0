"""Inputs for the quick-start demo: a resnet18 whose BN statistics are stale after a camera change.

``python -m bnrecal.service.demo DIR`` trains a real model and makes the mistake bnrecal exists
to repair, in about a minute on two CPU cores with nothing downloaded (once: a later run
reuses what it wrote, unless given ``--retrain``):

1. Data: scikit-learn's handwritten digits (1797 scans of 8x8 pixels, 10 classes, shipped
   inside scikit-learn), upscaled to 3x16x16; a seeded 360 are held out. 16x16 rather than
   32x32 because the resnet stem divides the side by four and the cost is in the wide late
   layers, so a larger image buys little accuracy for more time.
2. Training: a torchvision resnet18 (``num_classes=10``), 5 epochs of SGD with a one-cycle
   schedule on the training split, standardised with its pixel mean and std: about 0.97
   top-1 on the held-out split from the same scanner.
3. A new camera: the deployed model now sees scans with half the contrast on a grey
   background (``0.5 * pixel + 0.35`` before the unchanged standardisation), as when a
   sensor, its exposure or the lighting changes. The weights still recognise the digits,
   but every BN layer normalises with the old scanner's statistics and held-out accuracy
   collapses. Recomputing the statistics on unlabelled images from the new camera (the
   training scans as the new camera sees them) restores it: that is the demo's job for
   bnrecal. The damage is structural, not luck of a seed: the first BN sees an affine
   change of its input channel by channel, which only new statistics can undo.

Writes into DIR (float32 images, standardised as in training, fed to the model as is):

- ``resnet18-stale.pt``: ``{"model": state_dict, "epochs": 5}``, the trained model with its
  old-camera BN statistics (``--arch torchvision:resnet18 --model-kwargs '{"num_classes": 10}'``);
- ``calib.npy``: the training scans through the new camera, (1437, 3, 16, 16), unlabelled:
  calibration data;
- ``eval.npz``: the held-out scans through the new camera, ``x`` (360, 3, 16, 16) and ``y``
  int64 labels 0-9.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torchvision

SIZE = 16
HELD_OUT = 360
BATCH_SIZE = 64
TRAIN_EPOCHS = 5
LEARNING_RATE = 0.05
NEW_CAMERA_CONTRAST = 0.5
NEW_CAMERA_BRIGHTNESS = 0.35
MISSING_SKLEARN = "scikit-learn is missing; install the demo extra: .venv/bin/pip install -e '.[demo]'"


class MissingDemoExtra(ImportError):
    """The demo needs scikit-learn (the ``demo`` extra), which the service itself does not."""


class DemoInputs(NamedTuple):
    """Paths of the files ``write_demo_inputs`` wrote."""

    checkpoint: Path
    calib: Path
    eval: Path


class Digits(NamedTuple):
    """The digits as the model sees them: float32 (N, 3, SIZE, SIZE), int64 labels.

    ``train_x`` and ``eval_x`` come from the old scanner the model was trained on;
    ``new_train_x`` and ``new_eval_x`` are the same scans through the new camera.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    eval_x: torch.Tensor
    eval_y: torch.Tensor
    new_train_x: torch.Tensor
    new_eval_x: torch.Tensor


def load_digits_split(seed: int = 0) -> Digits:
    """Upscale scikit-learn's digits, hold out ``HELD_OUT`` (seeded), and add the new camera's view.

    Both views are standardised with the old scanner's training mean and std, as a deployed
    preprocessing pipeline would keep doing after the camera changed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise MissingDemoExtra(MISSING_SKLEARN) from exc
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    held_out, train = order[:HELD_OUT], order[HELD_OUT:]
    scans = torch.from_numpy(digits.images.astype(np.float32) / 16.0)[:, None]
    scans = torch.nn.functional.interpolate(scans, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    scans = scans.repeat(1, 3, 1, 1)
    new_scans = NEW_CAMERA_CONTRAST * scans + NEW_CAMERA_BRIGHTNESS
    mean, std = scans[train].mean(), scans[train].std()
    old, new = ((scans - mean) / std).contiguous(), ((new_scans - mean) / std).contiguous()
    labels = torch.from_numpy(digits.target.astype(np.int64))
    return Digits(old[train], labels[train], old[held_out], labels[held_out], new[train], new[held_out])


def train(x: torch.Tensor, y: torch.Tensor, seed: int = 0,
          on_epoch: Callable[[int, int], None] | None = None) -> torch.nn.Module:
    """A resnet18 trained on (x, y) with SGD and a one-cycle schedule, returned in eval mode;
    ``on_epoch(done, of)`` hears of the start (0) and of each epoch as it ends (training is most
    of a first demo's time)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    steps = -(-len(x) // BATCH_SIZE)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LEARNING_RATE,
                                                   total_steps=TRAIN_EPOCHS * steps, pct_start=0.25)
    model.train()
    if on_epoch is not None:
        on_epoch(0, TRAIN_EPOCHS)
    for epoch in range(TRAIN_EPOCHS):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), BATCH_SIZE):
            batch = order[start:start + BATCH_SIZE]
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
            schedule.step()
        if on_epoch is not None:
            on_epoch(epoch + 1, TRAIN_EPOCHS)
    return model.eval()


@contextmanager
def _cpu_threads() -> Iterator[None]:
    """Use every core this process may run on, then restore the caller's setting."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(cores)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_demo_inputs(folder: Path, seed: int = 0, on_epoch: Callable[[int, int], None] | None = None) -> DemoInputs:
    """Train and write the demo checkpoint, calibration and held-out data into ``folder``
    (``on_epoch`` as for ``train``).

    Deterministic for a given seed on a given machine and thread count; the global torch
    RNG and thread setting are left as they were.
    """
    digits = load_digits_split(seed)
    with _cpu_threads(), torch.random.fork_rng(devices=[]):
        model = train(digits.train_x, digits.train_y, seed, on_epoch)
    folder.mkdir(parents=True, exist_ok=True)
    paths = demo_paths(folder)
    np.save(paths.calib, digits.new_train_x.numpy())
    np.savez(paths.eval, x=digits.new_eval_x.numpy(), y=digits.eval_y.numpy())
    # the checkpoint last and whole: its presence says the folder's inputs are complete
    partial = paths.checkpoint.with_suffix(".partial")
    torch.save({"model": model.state_dict(), "epochs": TRAIN_EPOCHS}, partial)
    partial.replace(paths.checkpoint)
    return paths


def demo_paths(folder: Path) -> DemoInputs:
    """Where the demo's inputs lie in ``folder``."""
    return DemoInputs(folder / "resnet18-stale.pt", folder / "calib.npy", folder / "eval.npz")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m bnrecal.service.demo [DIR] [--retrain]`` (default ``demo``); prints
    the paths and the time. Inputs already in DIR are reused (training is most of the
    demo's time): ``--retrain``, or deleting them, trains again."""
    args = list(sys.argv[1:] if argv is None else argv)
    retrain = "--retrain" in args
    args = [arg for arg in args if arg != "--retrain"]
    target = Path(args[0] if args else "demo")
    if not retrain and all(path.is_file() for path in demo_paths(target)):
        for path in demo_paths(target):
            print(path)
        print(f"reusing the stale model trained earlier in {target}/ (--retrain to train it again)", file=sys.stderr)
        return 0
    start = time.perf_counter()

    def said(done: int, of: int) -> None:
        if done == 0:
            said_first = f"training the demo's stale resnet18 on scikit-learn's digits, {of} epochs (once: later runs reuse it)"
            print(said_first, file=sys.stderr, flush=True)
        else:
            print(f"  epoch {done}/{of}, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    try:
        paths = write_demo_inputs(target, on_epoch=said)
    except MissingDemoExtra as exc:
        print(f"bnrecal.service.demo: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    print(f"trained a resnet18 in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
