"""Where a rank's model comes from: an architecture reference plus the checkpoint's
weights, or a ``torch.export`` program that carries its own architecture.

The driver puts the weights in the object store once (a state dict, the program's
archive bytes, or a caller's live module); each rank builds its model from the source and those weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bnrecal.workers.models.skip_init import build_for_weights


@dataclass(frozen=True)
class ArchitectureSource:
    """A model built from ``arch`` and ``model_kwargs``; its weights are a state dict."""

    arch: str
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    allowed_modules: tuple[str, ...] = ()

    def build(self, weights: Mapping[str, torch.Tensor]) -> nn.Module:
        """The architecture with the checkpoint's weights loaded (every one of them: its random
        initialization is skipped, ``workers.models.skip_init``)."""
        model = build_for_weights(self.arch, self.model_kwargs, allowed_modules=self.allowed_modules)
        model.load_state_dict(weights)
        return model

    def describe(self) -> str:
        """What messages call the model."""
        return self.arch


@dataclass(frozen=True)
class ProgramSource:
    """A ``torch.export`` program; its weights are the archive's bytes (no code anywhere)."""

    name: str

    def build(self, weights: bytes) -> nn.Module:
        """The program, loaded without running anything the archive holds."""
        from bnrecal.workers.programs import load_program

        return load_program(weights, self.name)

    def describe(self) -> str:
        """What messages call the model."""
        return f"program {self.name}"


@dataclass(frozen=True)
class LiveModuleSource:
    """A caller's live module (``bnrecal.recalibrate``); its weights are the module itself,
    pickled by Ray with its class by reference, so the class's code must be importable on
    every node (a class defined in the caller's ``__main__`` travels by value)."""

    name: str

    def build(self, weights: nn.Module) -> nn.Module:
        """The module as it arrived: the object store already rebuilt it."""
        return weights

    def describe(self) -> str:
        """What messages call the model."""
        return f"model {self.name}"


ModelSource = ArchitectureSource | ProgramSource | LiveModuleSource
