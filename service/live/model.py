"""How a caller's live model is run or reaches the ranks, and how the statistics come back
into it. bnrecal is a guest in the caller's process: it never traces, exports or mutates
the caller's module itself (docs/python.md, "What differs, and why").

- **In the calling process** (one worker, no Ray): the pass runs on a *view* of the model
  (:func:`guest_view`): module objects of its own over the caller's parameter storage, so
  whatever a forward, a mode change or a memory layout does to modules happens to the
  view, and nothing large is copied.
- **As a ``torch.export`` program** (a Ray cluster the caller joined, which may span nodes
  without the caller's code): the view is traced on one batch, its outputs flattened to
  a tuple of tensors (so no output type, a Hugging Face ``ModelOutput`` or a dataclass,
  has to be rebuilt on the ranks), saved to bytes and loaded by the ranks the product's
  safe way. An ``ExportedProgram`` given directly travels the same way.
- **Pickled** with its class by reference (an embedded Ray started for the call, which runs
  on this machine with the driver's ``sys.path``; with ``forward``; batches whose shapes
  vary; a model that does not export): Ray reads the module to send it, never changes it.

Every path writes only the new BN statistics into the caller's own buffers, in place.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bnrecal.errors import SpecError, first_line
from bnrecal.workers.models.sources import LiveModuleSource, ModelSource, ProgramSource

from bnrecal.service.run.report.document import ModelSection

IN_PROCESS = "in-process"


@dataclass
class ShippedModel:
    """The model as the pass gets it: its source and weights (for the ranks), the driver's
    module whose BN layers name what is calibrated, and how updates reach the caller's model."""

    source: ModelSource
    weights: Any
    driver: nn.Module
    transport: str  # "in-process", "program" or "pickle"
    write_back: Callable[[dict[str, torch.Tensor]], None] | None = None
    notes: list[str] = field(default_factory=list)
    restore: Callable[[], None] | None = None  # puts the caller's modules back (a run on the model itself)

    def describe(self) -> ModelSection:
        """The report's ``model`` section: how the model travelled and why."""
        return ModelSection(transport=self.transport, name=self.source.name,  # type: ignore[union-attr]
                            notes=list(self.notes) or None)


def guest_view(model: nn.Module) -> nn.Module:
    """A copy of ``model`` to run and trace in its place: new module objects (their own
    ``__dict__``, training flags, hooks dicts, attributes) whose parameters are new
    ``Parameter`` objects over the caller's storage, whose BN running buffers are the
    caller's own tensors (so the statistics land in place), and whose other buffers are
    copies (a forward that updates a buffer in place updates the copy's). A forward that
    assigns an attribute (a cached grid), an export (which leaves fake tensors in such
    attributes), ``eval()`` or a memory-layout change touch the view only."""
    from bnrecal.workers.engine.batchnorm import find_batchnorm_layers

    layers, _ = find_batchnorm_layers(model)
    running = {id(tensor) for layer in layers for tensor in _running_buffers(layer)}
    memo: dict[int, Any] = {}
    for module in model.modules():
        for value in module.__dict__.values():  # plain tensor attributes: shared, never copied
            if isinstance(value, torch.Tensor):
                memo[id(value)] = value
        for buffer in module._buffers.values():
            if buffer is not None and id(buffer) not in memo:
                memo[id(buffer)] = buffer if id(buffer) in running else buffer.detach().clone()
        for param in module._parameters.values():
            if param is not None and id(param) not in memo:
                memo[id(param)] = nn.Parameter(param.detach(), requires_grad=param.requires_grad)
    return copy.deepcopy(model, memo)


def run_here(model: Any, device: str) -> ShippedModel:
    """The model for a run in the calling process: a :func:`guest_view` (or an
    ``ExportedProgram`` loaded as a program module), moved to ``device`` where needed."""
    if isinstance(model, torch.export.ExportedProgram):
        shipped = _program(program_bytes(model), "ExportedProgram", lambda updates: _write_program_state(model, updates))
        return ShippedModel(shipped.source, None, shipped.driver, IN_PROCESS, shipped.write_back)
    name = type(_module(model)).__qualname__
    try:
        view = guest_view(model)
    except Exception as exc:  # noqa: BLE001 - a module that does not deep-copy (a lock, a handle) runs itself
        if not _on(model, device):
            raise SpecError(
                f"model {name} does not deep-copy ({type(exc).__name__}: {first_line(exc)[:200]}), so it can only "
                f"run where it lives: give device={_device_of(model)!r}", field="device",
            ) from exc
        note = f"ran on the model itself, which does not deep-copy ({type(exc).__name__}); its modules were put back"
        return ShippedModel(LiveModuleSource(name), None, model, IN_PROCESS, None, [note], _module_state(model))
    if not _on(view, device):
        view.to(device)
    return ShippedModel(LiveModuleSource(name), None, view, IN_PROCESS, lambda updates: _write_module(model, updates))


def ship_model(model: Any, sample: Any, forward: Callable[..., Any] | None, prefer: str) -> ShippedModel:
    """Decide how ``model`` reaches the Ray ranks (see the module's docstring); ``sample``
    is one batch of the model's input (the probe's), used to trace an export. ``prefer``
    is ``program`` (a joined cluster: export when it can) or ``pickle`` (an embedded one).
    On an embedded Ray a model that neither pickles nor travels as a program is refused
    here (``SpecError``), before any rank starts."""
    if isinstance(model, torch.export.ExportedProgram):
        if forward is not None:
            raise SpecError("forward does not go with an ExportedProgram: it runs on its own inputs", field="forward")
        return _program(program_bytes(model), "ExportedProgram", lambda updates: _write_program_state(model, updates))
    name = type(_module(model)).__qualname__
    notes: list[str] = []
    cpu_model = on_cpu(model)
    write_back = lambda updates: _write_module(model, updates)  # noqa: E731
    problem = None  # why it does not pickle, where it was tried
    if prefer == "pickle":
        problem = pickle_problem(cpu_model)
        if problem is None:
            return _pickled(name, cpu_model, write_back, notes)
        notes.append(f"not pickled ({problem})")
    if forward is not None:
        notes.append("forward given: it runs on the live module")
    elif not isinstance(sample, torch.Tensor):
        notes.append("its input is not one tensor")
    else:
        try:
            data = program_bytes(export_program(cpu_model, sample))
            shipped = _program(data, f"{name}, as traced on the first batch", write_back, notes)
            _check_names(shipped.driver, cpu_model)
            return shipped
        except Exception as exc:  # noqa: BLE001 - any export failure means: pickle it
            notes.append(f"not exported ({type(exc).__name__}: {first_line(exc)[:200]})")
    if problem is not None:  # neither pickles nor travels as a program: refused before any rank starts
        raise cannot_send("model", problem)
    return _pickled(name, cpu_model, write_back, notes)


def on_cpu(model: nn.Module) -> nn.Module:
    """The model itself when it lives on the CPU, else a CPU copy (what the ranks get and
    the driver traces live on the CPU; updates go back into the original, on its device)."""
    if _on(model, "cpu"):
        return model
    return guest_view(model).cpu()


def export_program(model: nn.Module, sample: torch.Tensor) -> Any:
    """A :func:`guest_view` of ``model`` traced in eval mode on ``sample``, with a dynamic batch
    where torch allows, its outputs flattened to a tuple of tensors (the calibration never
    reads them; a ``ModelOutput`` or dataclass in the program's output spec would have to be
    importable wherever the program is loaded)."""
    from torch.utils._pytree import tree_leaves

    view = guest_view(model).eval()
    own_forward = view.forward

    def flat_forward(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(leaf for leaf in tree_leaves(own_forward(x)) if isinstance(leaf, torch.Tensor))

    view.forward = flat_forward  # type: ignore[method-assign]  # the view's own attribute, never the caller's
    batch = {0: torch.export.Dim.AUTO} if sample.shape[0] > 1 else None
    with warnings.catch_warnings():  # torch's advice on attributes a forward assigns is about the view, not for the caller
        warnings.simplefilter("ignore", UserWarning)
        return torch.export.export(view, (sample,), dynamic_shapes=(batch,) if batch else None)


def program_bytes(program: Any) -> bytes:
    """A program as the bytes of its ``.pt2`` archive."""
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def _module(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise SpecError(
            f"model must be a torch.nn.Module or ExportedProgram, got {type(model).__name__}", field="model"
        )
    return model


def _on(model: nn.Module, device: str) -> bool:
    wanted = torch.device(device).type
    return all(t.device.type == wanted for t in [*model.parameters(), *model.buffers()])


def _pickled(
    name: str, model: nn.Module, write_back: Callable[[dict[str, torch.Tensor]], None], notes: list[str]
) -> ShippedModel:
    """The model sent pickled (Ray reads it); the driver probes a view of it, or the model
    itself, put back after, when it does not deep-copy (then it rarely pickles either)."""
    try:
        return ShippedModel(LiveModuleSource(name), model, guest_view(model), "pickle", write_back, notes)
    except Exception:  # noqa: BLE001 - pickling it will say what is wrong, naming the model
        return ShippedModel(LiveModuleSource(name), model, model, "pickle", write_back, notes, _module_state(model))


def _device_of(model: nn.Module) -> str:
    return next((str(t.device) for t in [*model.parameters(), *model.buffers()]), "cpu")


def _module_state(model: nn.Module) -> Callable[[], None]:
    """What puts every module of ``model`` back as it is now: its attributes (a forward may
    assign some), its parameters', buffers' and submodules' entries, and its training flag."""
    saved = [
        (module, dict(module.__dict__), dict(module._parameters), dict(module._buffers), dict(module._modules))
        for module in model.modules()
    ]

    def restore() -> None:
        for module, attributes, parameters, buffers, modules in saved:
            for entries, own in ((parameters, module._parameters), (buffers, module._buffers), (modules, module._modules)):
                own.clear()
                own.update(entries)
            module.__dict__.clear()
            module.__dict__.update(attributes)

    return restore


def _running_buffers(layer: Any) -> list[torch.Tensor]:
    return [t for t in (layer.running_mean, layer.running_var, layer.num_batches_tracked) if t is not None]


class _Discard:
    """A file that keeps nothing: a pickling check costs no copy of what it pickles."""

    def write(self, data: bytes) -> int:
        return len(data)


def pickle_problem(value: Any) -> str | None:
    """Why Ray could not send ``value`` to the ranks (None when it can), found by pickling it
    as Ray does (its cloudpickle, with the serializers registered with Ray) into nothing:
    checked before any rank starts."""
    import pickle

    from ray import cloudpickle

    try:
        cloudpickle.CloudPickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the answer
        return f"{type(exc).__name__}: {first_line(exc)[:200]}"
    return None


SENT = {"model": "the model", "forward": "forward", "data": "the dataset (or its collate_fn)"}
"""What goes to the ranks, by the option that gives it, as an error names it."""


def cannot_send(field_name: str, problem: str) -> SpecError:
    """The one-line error for a part (``SENT``) that does not pickle."""
    return SpecError(
        f"{SENT[field_name]} cannot be sent to the Ray workers: {problem} (it must pickle: see docs/python.md)",
        field=field_name,
    )


def _program(
    data: bytes, name: str, write_back: Callable[[dict[str, torch.Tensor]], None], notes: list[str] | None = None
) -> ShippedModel:
    from bnrecal.workers.programs import load_program

    return ShippedModel(ProgramSource(name), data, load_program(data, name).eval(), "program", write_back, notes or [])


def _check_names(program: nn.Module, model: nn.Module) -> None:
    """Every running buffer the program calibrates is a buffer of the live model, same shape."""
    from bnrecal.workers.engine.batchnorm import find_batchnorm_layers

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
            if buffers[key] is not value:
                buffers[key].copy_(value.to(buffers[key].device, buffers[key].dtype))


def _write_program_state(program: Any, updates: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, value in updates.items():
            target = program.state_dict.get(key)
            if target is None:
                target = program.constants[key]
            target.copy_(value.to(target.device, target.dtype))
