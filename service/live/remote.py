"""``bnrecal.recalibrate(..., server=URL)``: the same recalibration as a job of a bnrecal server.

No code of the caller's reaches the server: the model goes as a ``torch.export`` program
and the data as one ``.npy`` array (read on the driver, up to ``max_samples``). A batch
that is not a plain tensor input (a dict with ``forward``) is packed: every tensor in it
is flattened per sample into one float32 row, and the program exported is a small wrapper
that unpacks the rows into the batch's structure (shapes and dtypes restored) and calls
``forward(model, batch)`` on it, traced once on the driver. Values in a batch that are not
tensors (lists of strings...) are not sent: ``forward`` sees ``None`` for them. The job's
recalibrated program comes back and its running buffers are written into the caller's
model, in place.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bnrecal.workers.data import DatasetSpec
from bnrecal.workers.data.formats.loader import LoaderSpec
from bnrecal.errors import SpecError

from bnrecal.service.run.options import RecalibrationOptions, RunOptions
from bnrecal.service.jobserver.records.spec import JobSpec

from ..client import BnrecalClient, input_digests, run_remote_job
from ..settings import Settings
from .data import describe_python_data
from .model import export_program, on_cpu, program_bytes
from bnrecal.service.run.report.document import ModelSection

from .report import RecalibrationReport

EXACT_FLOAT32_INTEGERS = 2**24
"""Integers a float32 row holds exactly: larger ones in an integer tensor are refused."""


@dataclass(frozen=True)
class _Leaf:
    """Where the i-th tensor of a packed batch goes in the batch's structure."""

    index: int


@dataclass(frozen=True)
class _Field:
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    stop: int


class PackedInput(nn.Module):
    """A model fed by ``forward(model, batch)``, taking the batch packed as float32 rows."""

    def __init__(self, model: nn.Module, forward: Callable[..., Any], template: Any, fields: list[_Field]) -> None:
        super().__init__()
        self.model = model
        self._feed = forward
        self._template = template
        self._fields = fields

    def forward(self, packed: torch.Tensor) -> Any:
        tensors = [
            packed[:, f.start:f.stop].reshape(-1, *f.shape).to(f.dtype) for f in self._fields
        ]
        return self._feed(self.model, _fill(self._template, tensors))


def recalibrate_on_server(
    model: Any,
    data: Any,
    *,
    server: str,
    api_key: str | None,
    options: RunOptions,
    asked: RecalibrationOptions,
    forward: Callable[..., Any] | None,
    progress: Callable[[str], Any],
) -> RecalibrationReport:
    """Run the recalibration as a job of the server at ``server`` and write the result into
    ``model`` in place (see the module's docstring): ``options`` as the run takes them,
    ``asked`` as the call gave them (its batch size and count of samples)."""
    if not isinstance(model, nn.Module):
        raise SpecError("with server=, model must be a torch.nn.Module", field="model")
    max_samples = asked.max_samples
    spec = describe_python_data(
        data, batch_size=asked.batch_size if "batch_size" in asked.model_fields_set else None, max_samples=max_samples,
        select_input=forward is None, settings=Settings(), order=options.order, seed=options.seed,
        image_column=options.image_column, transform=options.transform,
    )
    if isinstance(spec, DatasetSpec) and spec.remote is not None:
        raise SpecError("with server=, data in object storage is not sent: give a local path", field="data")
    live = on_cpu(model)
    with tempfile.TemporaryDirectory(prefix="bnrecal-") as folder:
        if isinstance(spec, LoaderSpec):
            rows, traced, prefix, step = _materialise(live, spec, forward)
            data_file = Path(folder) / "data.npy"
            np.save(data_file, rows)
            sample = torch.from_numpy(rows[: min(8, len(rows))])
        else:
            if forward is not None:
                raise SpecError("with server=, forward goes with batches given as Python objects", field="forward")
            traced, prefix, step, data_file = live, "", options.batch_size, Path(spec.path)
            with spec.open() as opened:
                sample = opened.load(0, min(8, spec.num_samples))
        program_file = Path(folder) / f"{type(model).__name__}.pt2"
        program_file.write_bytes(program_bytes(export_program(traced, sample)))
        inputs = {"program": program_file, "data": data_file}
        fields: dict[str, Any] = {
            "workers": options.workers, "mode": options.mode, "batch_size": step, "device": options.device,
            "outputs": ["program"], **input_digests(inputs),
        }
        fields.update({name: value for name, value in options.explicit().items()
                       if name in ("placement", "max_retries", "transform") and value is not None})
        if isinstance(spec, DatasetSpec) and max_samples is not None and not options.auto_samples:
            fields["max_samples"] = int(max_samples)
        if options.auto_samples:
            fields.update(max_samples="auto", tolerance=options.tolerance)
        # Data in memory keeps its own order (its rows were written in it); a path is read in the order asked.
        if isinstance(spec, LoaderSpec):
            fields["order"] = "given"
        else:
            fields.update(order=options.order, seed=options.seed)
            if options.image_column is not None:
                fields["image_column"] = options.image_column
        job_spec = JobSpec.checked(**fields)  # the typed spec: a field the server would refuse is refused here
        result = Path(folder) / "recalibrated.pt2"
        with BnrecalClient(server, api_key=api_key) as client:
            # A file the server already holds for this key (the same data, again) is not sent twice.
            job = run_remote_job(client, job_spec, inputs, follow=progress, downloads=lambda job: [("program", result)])
        _write_back(model, result, prefix)
    report = RecalibrationReport.from_dict(job.report or {})
    report.model = ModelSection(transport="program", name=type(model).__qualname__, server=server, job=job.id)
    return report


def _materialise(
    model: nn.Module, spec: LoaderSpec, forward: Callable[..., Any] | None
) -> tuple[np.ndarray, nn.Module, str, int]:
    """The data as one float32 array (packed when ``forward`` feeds the batches), the module
    to export, the prefix of its buffer names, and the global batch size."""
    sizes = spec.sizes
    if any(size != sizes[0] for size in sizes[:-1]) or sizes[-1] > sizes[0]:
        raise SpecError(
            "with server=, every batch but the last has the same size (the server's batch_size); "
            f"got {list(sizes)[:8]}",
            field="batch_size",
        )
    steps = [step.value for step in spec.rank_steps(0, 1)]
    if forward is None:
        rows = np.concatenate([torch.as_tensor(value).detach().cpu().float().numpy() for value in steps])
        return rows, model, "", sizes[0]
    template, fields, packed = None, None, []
    for value, size in zip(steps, sizes, strict=True):
        leaves: list[torch.Tensor] = []
        shape = _template(value, leaves)
        layout = [(tuple(leaf.shape[1:]), leaf.dtype) for leaf in leaves]
        if template is None:
            template, fields = shape, _fields(layout)
        elif shape != template or layout != [(f.shape, f.dtype) for f in fields or []]:
            raise SpecError("with server=, every batch has the same structure, shapes and dtypes", field="data")
        packed.append(np.concatenate([_row(leaf, size) for leaf in leaves], axis=1) if leaves else None)
    if not fields:
        raise SpecError("with server=, a batch holds at least one tensor", field="data")
    assert forward is not None
    return np.concatenate(packed), PackedInput(model, forward, template, fields), "model.", sizes[0]


def _row(leaf: torch.Tensor, size: int) -> np.ndarray:
    """One tensor of a batch as ``size`` float32 rows, refusing what float32 cannot hold exactly."""
    if leaf.dim() == 0 or leaf.shape[0] != size:
        raise SpecError(f"with server=, every tensor in a batch has the batch's {size} samples first", field="data")
    if not leaf.is_floating_point() and leaf.numel() and int(leaf.abs().max()) > EXACT_FLOAT32_INTEGERS:
        raise SpecError("with server=, integers in a batch must be below 2**24 (they travel as float32)", field="data")
    return leaf.detach().cpu().reshape(size, -1).to(torch.float32).numpy()


def _fields(layout: list[tuple[tuple[int, ...], torch.dtype]]) -> list[_Field]:
    fields, start = [], 0
    for shape, dtype in layout:
        width = int(np.prod(shape)) if shape else 1
        fields.append(_Field(shape, dtype, start, start + width))
        start += width
    return fields


def _template(value: Any, leaves: list[torch.Tensor]) -> Any:
    """The batch's structure with each tensor replaced by a :class:`_Leaf` (collected in
    ``leaves``) and everything that is not a tensor by ``None``."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return _Leaf(len(leaves) - 1)
    if isinstance(value, dict):
        return type(value)((key, _template(item, leaves)) for key, item in value.items())
    if isinstance(value, (tuple, list)) and any(isinstance(item, (torch.Tensor, np.ndarray, dict, tuple, list))
                                                 for item in value):
        parts = [_template(item, leaves) for item in value]
        return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)
    return None


def _fill(template: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(template, _Leaf):
        return tensors[template.index]
    if isinstance(template, dict):
        return type(template)((key, _fill(item, tensors)) for key, item in template.items())
    if isinstance(template, (tuple, list)):
        parts = [_fill(item, tensors) for item in template]
        return type(template)(*parts) if hasattr(template, "_fields") else type(template)(parts)
    return template


def _write_back(model: nn.Module, program: Path, prefix: str) -> None:
    """Copy the recalibrated program's running buffers into the caller's model."""
    from bnrecal.workers.engine.batchnorm import find_batchnorm_layers
    from bnrecal.workers.programs import load_program

    result = load_program(program, program.name)
    buffers = dict(model.named_buffers())
    layers, _ = find_batchnorm_layers(result)
    with torch.no_grad():
        for layer in layers:
            for role, key in layer.buffer_names().items():
                own = key[len(prefix):] if key.startswith(prefix) else key
                buffers[own].copy_(getattr(layer, role).to(buffers[own].device, buffers[own].dtype))
