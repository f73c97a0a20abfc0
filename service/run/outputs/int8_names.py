"""The INT8 options that name parts of the exported graph (``keep_float``) or op types
(``op_types``), checked before any calibration work (docs/int8.md, "Asking for it").

A name can only be checked against the graph the export will have. The stale model (the
checkpoint as uploaded) exports to the same graph as the recalibrated one: folds and node
names depend on the model's structure, never on its statistics. So when ``keep_float`` is
given, the stale model is exported once up front (seconds; only then), prepared as the
INT8 export prepares it, and each name resolved; a typo fails in seconds, not after the
calibration.
"""

from __future__ import annotations

from bnrecal.errors import ExportError, SpecError

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.int8.quantizer import check_op_types, prepare, resolve_keep_float
from bnrecal.service.run.request import RecalibrationRequest
from bnrecal.service.settings import Settings

PREFLIGHT_SAMPLES = 2


def check_int8_names(request: RecalibrationRequest, settings: Settings, options: Int8Options, *,
                     field: str = "int8", opset: int | None = None) -> None:
    """Raise ``SpecError`` naming ``{field}.keep_float`` or ``{field}.op_types`` when an entry
    names no node or op type of the graph the run will export; nothing to do without either."""
    if options.op_types is not None:
        try:
            check_op_types(options)
        except ExportError as exc:
            raise SpecError(f"{field}.{str(exc).removeprefix('int8.')}", field=f"{field}.op_types") from None
    if not options.keep_float:
        return
    from bnrecal.workers.data import ReadOptions, describe_dataset

    from bnrecal.service.export import export_folded_onnx
    from bnrecal.service.run.outputs.int8 import fp32_bytes_for
    from bnrecal.service.run.model_source import load_model
    from bnrecal.service.run.options import DEFAULT_OPSET

    loaded = load_model(
        settings, arch=request.arch, model_kwargs=request.model_kwargs, checkpoint=request.checkpoint,
        checkpoint_name=request.checkpoint_name, program=request.program, program_name=request.program_name,
    )
    dataset = describe_dataset(
        request.data, ReadOptions(transform=request.transform, name=request.data_name), settings.data_access(),
    )
    with dataset.open() as data:
        samples = data.load(0, min(PREFLIGHT_SAMPLES, dataset.num_samples))
    if len(samples) < PREFLIGHT_SAMPLES:
        samples = samples.repeat(PREFLIGHT_SAMPLES, *([1] * (samples.dim() - 1)))
    graph = fp32_bytes_for(lambda path: export_folded_onnx(loaded.model, samples, path, opset=opset or DEFAULT_OPSET))
    try:
        resolve_keep_float(prepare(graph), options.keep_float)
    except ExportError as exc:
        raise SpecError(f"{field}.{str(exc).removeprefix('int8.')}", field=f"{field}.keep_float") from None
