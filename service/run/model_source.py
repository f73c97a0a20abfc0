"""The model of a recalibration, as the user gave it: an architecture and a checkpoint,
or a ``torch.export`` program (docs/models.md).

``load_model`` builds the driver's copy and what the ranks need (the source and its
weights); ``LoadedModel.save`` writes the recalibrated result in the form it came in: the
checkpoint in its uploaded format and layout, or the same program archive with new
running buffers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bnrecal.workers.models.skip_init import build_for_weights
from bnrecal.workers.models.checkpoints import Checkpoint, load_checkpoint, load_into_model, save_checkpoint
from bnrecal.workers.models.model_check import check_checkpoint_fits
from bnrecal.workers.models.sources import ArchitectureSource, ModelSource, ProgramSource

from bnrecal.service.run.options import check_model_choice
from bnrecal.service.settings import Settings

PROGRAM_SUFFIX = ".pt2"
CHECKPOINT_SUFFIX = {"safetensors": ".safetensors", "torch": ".pt"}


@dataclass
class LoadedModel:
    """The driver's model, how the ranks rebuild it, and how its result is saved."""

    model: nn.Module
    source: ModelSource
    weights: Any
    label: str
    checkpoint: Checkpoint | None = None
    program: Path | None = None

    @property
    def is_program(self) -> bool:
        """Whether the model is a ``torch.export`` program."""
        return self.program is not None

    @property
    def suffix(self) -> str:
        """The file suffix of the recalibrated result (``.pt2``, ``.pt``, ``.safetensors``)."""
        if self.checkpoint is not None:
            return CHECKPOINT_SUFFIX[self.checkpoint.format]
        return PROGRAM_SUFFIX

    def save(self, updates: dict[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
        """Write the recalibrated checkpoint, or program, with ``updates`` (state-dict names)."""
        if self.checkpoint is not None:
            save_checkpoint(self.checkpoint, updates, path)
        else:
            from bnrecal.workers.programs import write_archive

            assert self.program is not None
            write_archive(self.program, updates, path)


def load_model(
    settings: Settings,
    *,
    arch: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    checkpoint: Path | None = None,
    checkpoint_name: str | None = None,
    program: Path | None = None,
    program_name: str | None = None,
) -> LoadedModel:
    """The driver's model, in eval mode, from an architecture and checkpoint or a program.

    A program is read without running anything it holds (``workers.programs``); its
    archive bytes are what the ranks load it from.
    """
    check_model_choice(arch, checkpoint, program, model_kwargs)
    if program is not None:
        from bnrecal.workers.programs import load_program

        name = program_name or Path(program).name
        data = Path(program).read_bytes()
        model = load_program(data, name)
        return LoadedModel(model.eval(), ProgramSource(name), data, f"program {name!r}", program=Path(program))
    assert arch is not None and checkpoint is not None
    allowed = tuple(settings.model_modules)
    # Shapes and size first, on the meta device: nothing a spec asks for is allocated unchecked.
    check_checkpoint_fits(
        arch, model_kwargs or {}, checkpoint, allowed_modules=allowed, max_bytes=settings.max_model_bytes,
        name=checkpoint_name,
    )
    model = build_for_weights(arch, model_kwargs or {}, allowed_modules=allowed)  # the load fills every weight
    loaded = load_checkpoint(checkpoint, checkpoint_name)
    load_into_model(model, loaded)
    model.eval()
    source = ArchitectureSource(arch, dict(model_kwargs or {}), allowed)
    return LoadedModel(model, source, model.state_dict(), arch, checkpoint=loaded)
