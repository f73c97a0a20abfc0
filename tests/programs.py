"""Programs as users make them (``torch.export.export`` then ``torch.export.save``), and
archives as an attacker would craft them from a real one."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn


def export_program(
    model: nn.Module, sample: torch.Tensor | tuple[torch.Tensor, ...], path: Path, *, dynamic: bool = False,
    decompose: bool = False,
) -> Path:
    """Export ``model`` (in eval mode) on ``sample`` and save it as a ``.pt2``: with a static
    batch (the sample's), or a dynamic batch dimension; optionally decomposed."""
    samples = sample if isinstance(sample, tuple) else (sample,)
    shapes = tuple({0: torch.export.Dim("batch")} for _ in samples) if dynamic else None
    program = torch.export.export(model.eval(), samples, dynamic_shapes=shapes)
    if decompose:
        program = program.run_decompositions()
    torch.export.save(program, path)
    return path


class _Touch:
    """Unpickling this creates ``path``: proof that a loader ran code from a file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def code_pickle(marker: Path, *, torch_format: bool = True) -> bytes:
    """A pickle that runs ``touch marker`` when loaded (in torch's zip format, or plain)."""
    if not torch_format:
        return pickle.dumps(_Touch(marker), protocol=2)
    buffer = io.BytesIO()
    torch.save(_Touch(marker), buffer)
    return buffer.getvalue()


def members(path: Path) -> dict[str, bytes]:
    """An archive's members by name, in order."""
    with zipfile.ZipFile(path) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def write_members(path: Path, contents: dict[str, bytes]) -> Path:
    """Write members as a zip (stored, like torch's archives)."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in contents.items():
            archive.writestr(name, data)
    return path


def rewrite(source: Path, target: Path, change: Any) -> Path:
    """A copy of ``source`` whose members ``change(name, data)`` may replace (None keeps it)."""
    contents = members(source)
    changed = {}
    for name, data in contents.items():
        replaced = change(name, data)
        changed[name] = data if replaced is None else replaced
    return write_members(target, changed)


def rewrite_graph(source: Path, target: Path, change: Any) -> Path:
    """A copy of ``source`` whose graph document (``models/model.json``) ``change`` edits in place."""
    def edit(name: str, data: bytes) -> bytes | None:
        if not name.endswith("/models/model.json"):
            return None
        document = json.loads(data)
        change(document)
        return json.dumps(document).encode()

    return rewrite(source, target, edit)


def rewrite_json(source: Path, target: Path, suffix: str, change: Any) -> Path:
    """A copy of ``source`` whose JSON member ending in ``suffix`` ``change`` edits in place."""
    def edit(name: str, data: bytes) -> bytes | None:
        if not name.endswith(suffix):
            return None
        document = json.loads(data)
        change(document)
        return json.dumps(document).encode()

    return rewrite(source, target, edit)


def buffers_as_modules(program: nn.Module) -> nn.Module:
    """A module tree holding a program's BN buffers at their layers' paths, so the
    reference check (``tests/reference.py``, which looks layers up by module name) reads
    a program's recalibrated statistics as it reads an eager model's."""
    from bnrecal.workers.engine.batchnorm import find_batchnorm_layers

    root = nn.Module()
    for layer in find_batchnorm_layers(program)[0]:
        holder = nn.Module()
        holder.running_mean, holder.running_var = layer.running_mean, layer.running_var
        parent = root
        *parents, last = layer.name.split(".")
        for part in parents:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        parent.add_module(last, holder)
    return root
