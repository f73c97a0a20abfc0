"""Exporting a recalibrated model to folded ONNX, with the samples that verify it."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bnrecal.workers.data import ReadOptions, describe_dataset
from bnrecal.errors import EvaluationError, SpecError
from bnrecal.workers.models.architectures import build_model
from bnrecal.workers.models.checkpoints import load_checkpoint, load_into_model
from bnrecal.workers.models.sources import ModelSource
from bnrecal.workers.ranks.process.scoped import scope_object

from bnrecal.service.export.graph_reuse import GraphReuse, TracedGraph
from bnrecal.service.export.report_sections import Int8Section, OnnxSection
from bnrecal.service.export.verification import VERIFY_SAMPLES
from bnrecal.service.run.options import DEFAULT_OPSET, ExportOptions
from bnrecal.service.run.request import Recalibration
from bnrecal.service.report_part import ReportPart
from bnrecal.service.settings import Settings
from bnrecal.workers.tracing import holds_tracing



def export_recalibrated(
    result: Recalibration,
    path: str | os.PathLike[str],
    *,
    opset: int = DEFAULT_OPSET,
    dtype: str = "float32",
    dynamic_batch: bool = True,
    input_shape: Sequence[int] | None = None,
    model: torch.nn.Module | None = None,
    reuse: GraphReuse | None = None,
    openvino: bool = True,
) -> OnnxSection:
    """Fold and export the recalibrated model (or ``model``, e.g. the stale one) in this
    process, verified on its own calibration samples (``reuse`` and ``openvino``:
    ``export_folded_onnx``'s).

    Returns the report's ``onnx`` section; raises ``ExportError`` (and writes nothing)
    when the export cannot be verified. A run's own exports run where its ranks run
    (``export_models``).
    """
    from bnrecal.service.export import export_folded_onnx

    fixed, dynamic_batch = export_batch(result.model, dynamic_batch)
    samples = result.calibration_samples(max(VERIFY_SAMPLES, fixed))
    return export_folded_onnx(
        result.model if model is None else model, samples, path, opset=opset, dtype=dtype, dynamic_batch=dynamic_batch,
        input_shape=input_shape, fixed_batch=fixed, reuse=reuse, openvino=openvino,
    )


def export_batch(model: torch.nn.Module, dynamic_batch: bool) -> tuple[int, bool]:
    """The batch an export is made and verified at, and whether its batch axis is dynamic: a
    program exported with a static batch exports at that batch, and only there."""
    from bnrecal.workers.programs import ProgramModule

    if isinstance(model, ProgramModule) and model.batch.static:
        return model.batch.low, False
    return 1, dynamic_batch


@dataclass(frozen=True)
class ModelBuild:
    """How a process without the run's model (a rank) builds it: the run's model source and
    weights (as the statistics' ranks build it), with the recalibrated BN buffers
    (``updates``) or, for the stale model, the buffers it had (``stale_buffers``)."""

    source: ModelSource
    weights: Any
    updates: dict[str, torch.Tensor]
    stale_buffers: dict[str, torch.Tensor]

    @classmethod
    def of(cls, result: Recalibration) -> ModelBuild:
        """The recalibrated model of ``result``, to build elsewhere."""
        return cls(result.loaded.source, result.loaded.weights, result.updates, result.stale_buffers)

    def build(self, stale: bool = False) -> torch.nn.Module:
        """The recalibrated model (or the stale one), in eval mode."""
        model = self.source.build(self.weights)
        state = model.state_dict()
        with torch.no_grad():
            for key, value in (self.stale_buffers if stale else self.updates).items():
                state[key].copy_(value)
        return model.eval()


@dataclass(frozen=True)
class ExportAsk:
    """One folded export a run makes: of the recalibrated model or the stale one, in
    ``dtype``, checked in OpenVINO too or not (a file nobody deploys, the stale model's)."""

    stale: bool = False
    dtype: str = "float32"
    openvino: bool = True


@dataclass(frozen=True)
class ExportedFile:
    """An export's bytes, its report section, the seconds it took, and which of its outputs
    holds the class scores (``scores_output``: the output an INT8 file's passes score)."""

    model: bytes
    section: OnnxSection
    seconds: float
    scores: int = 0


@dataclass(frozen=True)
class ExportWork:
    """A run's exports, as the rank that makes them gets them: the model to build, the
    samples that verify each file, the exports asked for, the export options, the batch
    ``export_batch`` gave (``fixed``, ``dynamic_batch``), and the run's ``scope`` on its ranks."""

    build: ModelBuild
    samples: torch.Tensor
    asks: tuple[ExportAsk, ...]
    export: ExportOptions
    fixed: int
    dynamic_batch: bool
    scope: str | None = None


def export_models(work: ExportWork, traced: TracedGraph | None = None) -> list[ExportedFile]:
    """Each export of ``work.asks`` of the model ``work.build`` makes, verified on its samples:
    a run's exports, run where its ranks run (one trace of the exporter for all of them,
    ``GraphReuse``; none where the host made it ahead, ``traced``: ``TraceAhead``), so that the job's
    host does no export. With the run's ``scope`` the trace stays in this process for the
    scope's next export (a sweep's next cell of the same architecture:
    ``workers.ranks.process.scoped``)."""
    from bnrecal.service.export import export_folded_onnx

    reuse = scope_object(work.scope, GraphReuse) if work.scope is not None else GraphReuse()
    if traced is not None:
        reuse.traced = traced
    models = {stale: work.build.build(stale) for stale in {ask.stale for ask in work.asks}}
    # the stale model's structure is the same: one forward finds the scores for both
    scores = scores_output(next(iter(models.values())), work.samples[:work.fixed])
    exported = []
    with tempfile.TemporaryDirectory(prefix="bnrecal-export-") as tmp:
        for number, ask in enumerate(work.asks):
            started, path = time.monotonic(), Path(tmp) / f"{number}.onnx"
            section = export_folded_onnx(
                models[ask.stale], work.samples, path, opset=work.export.opset, dtype=ask.dtype,  # type: ignore[arg-type]
                dynamic_batch=work.dynamic_batch, input_shape=work.export.input_shape, fixed_batch=work.fixed,
                reuse=reuse, openvino=ask.openvino,
            )
            exported.append(ExportedFile(path.read_bytes(), section, time.monotonic() - started, scores))
    return exported


@holds_tracing
def scores_output(model: torch.nn.Module, sample: torch.Tensor) -> int:
    """Which output of the exported graph holds the class scores: the one evaluation reads
    (``model_logits``: a tensor, a mapping's ``out`` or ``logits``, a tuple's first), among
    the model's outputs in the exporters' order."""
    from bnrecal.workers.engine.evaluation import model_logits

    from bnrecal.service.export.verification import flatten_outputs

    modes = [(module, module.training) for module in model.modules()]
    try:
        with torch.no_grad():
            output = model.eval()(sample.to(torch.float32))
    finally:
        for module, training in modes:
            module.training = training
    try:
        logits = model_logits(output)
    except EvaluationError:
        return 0
    return next((i for i, tensor in enumerate(flatten_outputs(output)) if tensor is logits), 0)


def export_checkpoint(
    arch: str,
    checkpoint: str | os.PathLike[str],
    path: str | os.PathLike[str],
    settings: Settings,
    *,
    model_kwargs: dict[str, Any] | None = None,
    data: str | os.PathLike[str] | None = None,
    transform: dict[str, Any] | None = None,
    input_shape: Sequence[int] | None = None,
    opset: int = DEFAULT_OPSET,
    dtype: str = "float32",
    dynamic_batch: bool = True,
) -> ExportReport:
    """Fold and export a checkpoint as it is, without recalibrating it.

    The export is verified on the first calibration samples of ``data``, or, without
    data, on seeded random samples of ``input_shape``. Returns a report with the
    ``onnx`` section (``bnrecal export --report``; ``int8`` is set by ``--onnx-int8``).
    """
    from bnrecal.service.export import export_folded_onnx

    if data is None and input_shape is None:
        raise SpecError("give --data (samples to verify the export on) or --input-shape", field="data")
    model = build_model(arch, model_kwargs or {}, allowed_modules=tuple(settings.model_modules))
    load_into_model(model, load_checkpoint(checkpoint))
    model.eval()
    if data is not None:
        access = settings.data_access()  # s3:// data through the configured endpoint, as every other surface reads it
        spec = describe_dataset(data, ReadOptions(transform=transform), access)
        with spec.open() as opened:
            samples = opened.load(0, min(VERIFY_SAMPLES, spec.num_samples))
        if samples.shape[0] < 2:
            samples = torch.cat([samples, samples])
    else:
        generator = torch.Generator().manual_seed(0)
        samples = torch.randn((VERIFY_SAMPLES, *input_shape), generator=generator)  # type: ignore[misc]
    section = export_folded_onnx(
        model, samples, path, opset=opset, dtype=dtype, dynamic_batch=dynamic_batch, input_shape=input_shape
    )
    return ExportReport(arch=arch, checkpoint=str(checkpoint), onnx=section)


class ExportReport(ReportPart):
    """``bnrecal export``'s smaller report (docs/report.md, "The `onnx` section"): the
    architecture, the checkpoint, its export and, with ``--onnx-int8``, its INT8 file."""

    OMIT_WHEN_NONE = frozenset({"int8"})

    arch: str
    checkpoint: str
    onnx: OnnxSection
    int8: Int8Section | None = None
