"""Tiny Hugging Face ``transformers`` vision models with BN, as users save them: a config
small enough to calibrate and export in seconds, ``save_pretrained``'s config.json and
model.safetensors. The tests that use them skip where the extra is not installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

TINY: dict[str, dict[str, Any]] = {
    "ResNetForImageClassification": {
        "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "layer_type": "basic", "num_labels": 5,
    },
    "RegNetForImageClassification": {
        "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "groups_width": 4, "num_labels": 5,
    },
    "MobileNetV2ForImageClassification": {
        "depth_multiplier": 0.35, "min_depth": 4, "finegrained_output": False, "image_size": 32, "num_labels": 5,
    },
    "EfficientNetForImageClassification": {
        # hidden_dim must be round_filters(1280) at this width, or top_bn gets the wrong channels
        "width_coefficient": 0.25, "depth_coefficient": 0.3, "hidden_dim": 320, "image_size": 32, "num_labels": 5,
    },
}
SIZE = 32  # input height and width the tiny configs are meant for


def tiny_model(name: str, **overrides: Any) -> nn.Module:
    """A tiny ``transformers.<name>`` with the class's own random initial weights, in eval mode."""
    import transformers

    cls = getattr(transformers, name)
    torch.manual_seed(0)
    return cls(cls.config_class(**{**TINY[name], **overrides})).eval()


def save_pretrained(model: nn.Module, folder: Path) -> tuple[dict[str, Any], Path]:
    """Save ``model`` as users do; returns the content of its config.json and its model.safetensors."""
    model.save_pretrained(folder)
    return json.loads((folder / "config.json").read_text()), folder / "model.safetensors"
