"""Exporting a recalibrated model to folded ONNX, with the samples that verify it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from bnrecal.workers.data import ReadOptions, describe_dataset
from bnrecal.errors import EvaluationError, SpecError
from bnrecal.workers.models.architectures import build_model
from bnrecal.workers.models.checkpoints import load_checkpoint, load_into_model

from bnrecal.service.export.graph_reuse import GraphReuse
from bnrecal.service.export.report_sections import Int8Section, OnnxSection
from bnrecal.service.export.verification import VERIFY_SAMPLES
from bnrecal.service.run.options import DEFAULT_OPSET
from bnrecal.service.run.recalibration import Recalibration
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
    """Fold and export the recalibrated model (or ``model``, e.g. the stale one), verified on
    its own calibration samples (``reuse`` and ``openvino``: ``export_folded_onnx``'s).

    Returns the report's ``onnx`` section; raises ``ExportError`` (and writes nothing)
    when the export cannot be verified.
    """
    from bnrecal.workers.programs import ProgramModule

    from bnrecal.service.export import export_folded_onnx

    fixed = 1
    if isinstance(result.model, ProgramModule) and result.model.batch.static:
        # a program exported with a static batch exports at that batch, and only there
        fixed, dynamic_batch = result.model.batch.low, False
    samples = result.calibration_samples(max(VERIFY_SAMPLES, fixed))
    return export_folded_onnx(
        result.model if model is None else model, samples, path, opset=opset, dtype=dtype, dynamic_batch=dynamic_batch,
        input_shape=input_shape, fixed_batch=fixed, reuse=reuse, openvino=openvino,
    )


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
