"""Checkpoints as training wrappers write them: a Lightning ``.ckpt`` built by hand (no
lightning dependency), and a model held under an attribute as DDP and Lightning hold it."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

LIGHTNING_VERSION = "2.4.0"


def holding(model: nn.Module, attribute: str) -> nn.Module:
    """A bare module holding ``model`` as ``self.<attribute>`` (dotted: nested), as a
    LightningModule (``model``) or DDP (``module``) does: its ``state_dict()`` has the
    attribute as a key prefix, and torch's ``_metadata`` to match."""
    outer = nn.Module()
    holder = outer
    *parents, last = attribute.split(".")
    for name in parents:
        inner = nn.Module()
        holder.add_module(name, inner)
        holder = inner
    holder.add_module(last, model)
    return outer


def lightning_checkpoint(model: nn.Module, attribute: str = "model", seed: int = 0) -> dict[str, Any]:
    """What ``Trainer.save_checkpoint`` writes for a LightningModule holding ``model`` as
    ``self.<attribute>``: the weights under ``state_dict`` with the attribute as prefix,
    and real Adam and StepLR states (tensors, ints, tuples), hyper-parameters, callback
    and loop states. ``model`` itself is left untouched (the optimizer steps a copy)."""
    module = holding(model, attribute)
    trained = copy.deepcopy(module)
    optimizer = torch.optim.Adam(trained.parameters(), lr=1e-3, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(3):
        for parameter in trained.parameters():
            parameter.grad = torch.randn(parameter.shape, generator=generator)
        optimizer.step()
        scheduler.step()
    score = torch.tensor(0.4321)
    checkpoint_callback = (
        "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', 'every_n_train_steps': 0, "
        "'every_n_epochs': 1, 'train_time_interval': None}"
    )
    return {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": LIGHTNING_VERSION,
        "state_dict": module.state_dict(),
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_loop.state_dict": {"_batches_that_stepped": 120},
                "epoch_progress": {"total": {"ready": 4, "started": 4, "processed": 4, "completed": 3}},
            }
        },
        "callbacks": {
            checkpoint_callback: {
                "monitor": "val_loss",
                "best_model_score": score,
                "best_model_path": "/runs/7/epoch=2.ckpt",
                "current_score": score,
                "dirpath": "/runs/7",
                "best_k_models": {"/runs/7/epoch=2.ckpt": score},
                "kth_best_model_path": "/runs/7/epoch=2.ckpt",
                "kth_value": score,
                "last_model_path": "",
            },
            "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}": {
                "wait_count": 1, "stopped_epoch": 0, "best_score": score, "patience": 3,
            },
        },
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [scheduler.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 1e-3, "betas": (0.9, 0.999), "milestones": [10, 20], "name": "run-7", "dropout": None},
    }
