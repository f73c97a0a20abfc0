"""How a caller's live model reaches the ranks, and how their statistics come back into it.

- As a ``torch.export`` program when it exports: traced on the driver with one sample
  batch (a dynamic batch dimension where torch can give one), saved to bytes and
  loaded by the ranks the product's safe way (``workers.programs``), so no code of the
  caller's is needed anywhere. An ``ExportedProgram`` given directly travels the same way.
- Otherwise, and always with ``forward`` (which the program cannot run), pickled by Ray
  with its class by reference: the class's code must be importable on every node (one
  defined in the caller's ``__main__`` travels by value).

Either way the driver writes the new statistics into the caller's own buffers, in place.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from workers.errors import SpecError, first_line
from workers.models.sources import LiveModuleSource, ModelSource, ProgramSource


@dataclass
class ShippedModel:
    """The model as the ranks get it: its source and weights, the driver's copy whose BN
    layers name what the ranks calibrate, and how updates reach the caller's model."""

    source: ModelSource
    weights: Any
    driver: nn.Module
    transport: str  # "program" or "pickle"
    write_back: Callable[[dict[str, torch.Tensor]], None] | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        """The report's ``model`` section: how the model travelled and why."""
        info: dict[str, Any] = {"transport": self.transport, "name": self.source.name}  # type: ignore[union-attr]
        if self.notes:
            info["notes"] = self.notes
        return info


def ship_model(model: Any, sample: Any, forward: Callable[..., Any] | None) -> ShippedModel:
    """Decide how ``model`` travels (see the module's docstring); ``sample`` is one batch
    of the model's input (the probe's), used to trace the export."""
    if isinstance(model, torch.export.ExportedProgram):
        if forward is not None:
            raise SpecError("forward does not go with an ExportedProgram: it runs on its own inputs", field="forward")
        return _program(program_bytes(model), "ExportedProgram", lambda updates: _write_program_state(model, updates))
    if not isinstance(model, nn.Module):
        raise SpecError(
            f"model must be a torch.nn.Module or ExportedProgram, got {type(model).__name__}", field="model"
        )
    name = type(model).__qualname__
    notes: list[str] = []
    cpu_model = on_cpu(model)
    if forward is not None:
        notes.append("forward given: it runs on the live module")
    elif isinstance(sample, torch.Tensor):
        try:
            data = program_bytes(export_program(cpu_model, sample))
            shipped = _program(data, name, lambda updates: _write_module(model, updates))
            _check_names(shipped.driver, cpu_model)
            return shipped
        except Exception as exc:  # noqa: BLE001 - any export failure means: pickle it
            notes.append(f"not exported ({type(exc).__name__}: {first_line(exc)[:200]})")
    write_back = None if cpu_model is model else (lambda updates: _write_module(model, updates))
    return ShippedModel(LiveModuleSource(name), cpu_model, cpu_model, "pickle", write_back, notes)


def on_cpu(model: nn.Module) -> nn.Module:
    """The model itself when it lives on the CPU, else a CPU copy (the driver's work and what
    the ranks get happen on the CPU; updates go back into the original, on its device)."""
    if all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()]):
        return model
    return copy.deepcopy(model).cpu()


def export_program(model: nn.Module, sample: torch.Tensor) -> Any:
    """The model traced in eval mode on ``sample``, with a dynamic batch where torch allows
    (the caller's training flag is put back)."""
    was_training = model.training
    model.eval()
    try:
        batch = {0: torch.export.Dim.AUTO} if sample.shape[0] > 1 else None
        return torch.export.export(model, (sample,), dynamic_shapes=(batch,) if batch else None)
    finally:
        model.train(was_training)


def program_bytes(program: Any) -> bytes:
    """A program as the bytes of its ``.pt2`` archive."""
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def _program(data: bytes, name: str, write_back: Callable[[dict[str, torch.Tensor]], None]) -> ShippedModel:
    from workers.programs import load_program

    label = f"{name}.pt2"
    return ShippedModel(ProgramSource(label), data, load_program(data, label).eval(), "program", write_back)


def _check_names(program: nn.Module, model: nn.Module) -> None:
    """Every running buffer the program calibrates is a buffer of the live model, same shape."""
    from workers.engine.batchnorm import find_batchnorm_layers

    buffers = dict(model.named_buffers())
    layers, _ = find_batchnorm_layers(program)
    for layer in layers:
        for role, key in layer.buffer_names().items():
            if key not in buffers or buffers[key].shape != getattr(layer, role).shape:
                raise SpecError(f"the program's buffer {key} is not one of the model's")


def _write_module(model: nn.Module, updates: dict[str, torch.Tensor]) -> None:
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for key, value in updates.items():
            buffers[key].copy_(value.to(buffers[key].device, buffers[key].dtype))


def _write_program_state(program: Any, updates: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, value in updates.items():
            target = program.state_dict.get(key)
            if target is None:
                target = program.constants[key]
            target.copy_(value.to(target.device, target.dtype))
