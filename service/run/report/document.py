"""The run report (docs/report.md): what was done, where, how fast, and per layer.

One typed object, :class:`Report`, built once by the run core (``service.run.core``) from
what the ranks returned; the phases after the statistics (the ONNX and INT8 exports, the
server's job label) fill their own section, and the report is serialised once
(:meth:`Report.to_dict`, :func:`write_report`). Every part is a typed model
(``service.report_part``; the ``onnx`` and ``int8`` sections are the exports' own,
``service.export.report_sections``), read by attribute or by its JSON key
(``report["samples"]``, ``report.get("onnx")``: the same objects, nothing copied), so code
that reads a ``report.json`` reads the object the same way.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

import torch

from bnrecal.workers.engine.batchnorm import BatchNormLayer, SkippedLayer
from bnrecal.workers.files import atomic_write
from bnrecal.workers.ranks.process.work import IN_PROCESS

from bnrecal.service.export.report_sections import Int8Section, OnnxSection, OpenVinoSection
from bnrecal.service.report_part import ReportPart
from bnrecal.service.run.options import AUTO, RunOptions

if TYPE_CHECKING:  # annotations only: writing a report (bnrecal export) needs neither Ray nor the data readers
    from bnrecal.workers.data.summary import DatasetSummary
    from bnrecal.workers.engine.evaluation import EvalMetrics, ModelScores
    from bnrecal.workers.engine.moments import MomentStats
    from bnrecal.workers.ranks.plan import GroupResult

@dataclass(frozen=True)
class LayerDrift:
    """A calibrated layer with its old running mean and variance, its call count on rank 0
    and its new statistics (with standard errors when estimated)."""

    layer: BatchNormLayer
    old_mean: torch.Tensor
    old_var: torch.Tensor
    calls: int
    stats: MomentStats | None = None


class LayerReport(ReportPart):
    """How far one layer's statistics moved, and how precisely they are known (``layers[]``;
    ``class_name`` is written as ``class``)."""

    name: str
    class_name: str = Field(alias="class")
    channels: int
    calls: int
    mean_shift: float | None
    var_ratio_max: float | None
    var_ratio_min: float | None
    se_mean_max: float | None = None
    se_mean_median: float | None = None
    se_var_max: float | None = None
    se_var_median: float | None = None


PYTORCH_RUNTIME, ONNX_RUNTIME = "pytorch", "onnxruntime"
"""Where the evaluation before and after was measured (``evaluation.runtime``): the model
itself beside the statistics, or its folded FP32 exports in the INT8 export's passes."""


class SkippedLayerReport(ReportPart):
    """A BN layer left as it was, and why (``skipped[]``)."""

    name: str
    reason: str


class WorstError(ReportPart):
    """The largest standard error of any layer's new statistics (``standard_error_max``)."""

    layer: str
    statistic: str
    error: float


class Convergence(ReportPart):
    """Where a ``max_samples: "auto"`` run stopped (``convergence``)."""

    tolerance: float
    converged: bool
    samples: int
    available_samples: int
    steps: int
    min_steps: int | None
    worst: WorstError | None


class DatasetReport(ReportPart):
    """The calibration data as used (``dataset``)."""

    kind: str
    samples: int
    sample_shape: list[int]


class TimelineEntry(ReportPart):
    """One phase of the run (``timeline[]``): its wall seconds, the samples it read, its
    passes over them, and where it ran (``ranks``, ``in-process`` for a one-worker run in
    the calling process, or ``host`` for the driver's own work)."""

    phase: str
    seconds: float
    samples: int
    passes: int
    where: str


def where_ranks_ran(report: Report) -> str:
    """A timeline entry's ``where`` for the run's passes over the data: ``in-process`` for one
    worker in the calling process, else ``ranks``."""
    return IN_PROCESS if report.backend == IN_PROCESS else "ranks"


def add_to_timeline(report: Report, phase: str, seconds: float, samples: int, passes: int, where: str) -> None:
    """Count a phase in the report's timeline, added to its earlier entry of the same name
    (a second range pass, another scoring pass)."""
    for entry in report.timeline:
        if entry.phase == phase and entry.where == where:
            entry.seconds = round(entry.seconds + seconds, 6)
            entry.samples += samples
            entry.passes += passes
            return
    report.timeline.append(TimelineEntry(phase=phase, seconds=round(seconds, 6), samples=samples, passes=passes,
                                          where=where))


class DecodingReport(ReportPart):
    """What the ranks decoded over the whole job (``decoding``, docs/report.md): each decode
    of a sample, the reads later passes took from what the ranks kept, the bytes kept in
    memory and spilled to local disk, the samples no budget had room for, and each rank's
    budgets."""

    decoded: int
    reused: int
    kept_bytes: int
    spilled_bytes: int
    not_kept: int
    memory_budget_bytes: int
    disk_budget_bytes: int


@dataclass(frozen=True)
class Placement:
    """Where and how the ranks ran: facts only the executor knows."""

    backend: str
    placement: str
    data_transport: str
    cpus_per_worker: float
    embedded_cluster: bool
    object_store_bytes: int = 0


class DataSummary(ReportPart):
    """Data as a run used it (``data``, ``evaluation.data``): its kind, where it came from,
    how many samples of how many, their shape and order; arrays add their storage, shards
    their format, images their transform. Fields a reader of this release does not know
    are kept as they came."""

    OMIT_WHEN_NONE = frozenset({"order", "seed", "steps", "storage", "dtype", "array", "transform", "classes",
                                "format", "shards", "image_column"})

    kind: str
    source: str | None = None
    samples: int
    steps: int | None = None
    total_samples: int | None = None
    sample_shape: list[int]
    order: str | None = None
    seed: int | None = None
    storage: str | None = None
    dtype: str | None = None
    array: str | None = None
    transform: dict[str, Any] | None = None  # the transform as given (docs/data.md), free-form
    classes: int | None = None
    format: str | None = None
    shards: int | None = None
    image_column: str | None = None

    @classmethod
    def of(cls, summary: DatasetSummary) -> DataSummary:
        """The part for data as its description sums it up (``DatasetSpec.summary``,
        ``LoaderSpec.summary``): the same fields, the transform in its job-spec form."""
        values = {field.name: getattr(summary, field.name) for field in fields(summary)}
        transform = summary.transform.to_dict() if summary.transform is not None else None
        return cls(**values | {"sample_shape": list(summary.sample_shape), "transform": transform})


class ModelSection(ReportPart):
    """How the Python API's model travelled (``model``): ``program`` or ``pickle``, its name,
    why an export was not used; or the server and job it ran as."""

    OMIT_WHEN_NONE = frozenset({"notes", "server", "job"})

    transport: str
    name: str
    notes: list[str] | None = None
    server: str | None = None
    job: str | None = None


class ProgramSection(ReportPart):
    """A ``torch.export`` program's name and how its batch dimension is fed (``program``)."""

    name: str
    batch: str


class Scores(ReportPart):
    """One model's accuracy on the labelled evaluation data (top-5 with 10 classes or more)."""

    OMIT_WHEN_NONE = frozenset({"top5"})

    top1: float
    top5: float | None = None
    cross_entropy: float

    @classmethod
    def of(cls, scores: ModelScores | None) -> Scores | None:
        """The scores as the ranks measured them."""
        if scores is None:
            return None
        return cls(top1=scores.top1, top5=scores.top5, cross_entropy=scores.cross_entropy)


class EvaluationSection(ReportPart):
    """The evaluation before and after (``evaluation``, docs/evaluation.md)."""

    OMIT_WHEN_NONE = frozenset({"before", "after", "note"})

    data: DataSummary
    samples: int
    classes: int
    output_shape: list[int]
    labelled: bool
    prediction_change: float
    kl_divergence: float
    before: Scores | None = None
    after: Scores | None = None
    note: str | None = None
    seconds: float
    collectives: int
    runtime: Literal["pytorch", "onnxruntime"]

    @classmethod
    def of(cls, data: DataSummary, metrics: EvalMetrics, seconds: float, runtime: str) -> EvaluationSection:
        """The section from the ranks' combined metrics (``workers.engine.evaluation``)."""
        return cls(
            data=data, samples=metrics.samples, classes=metrics.classes, output_shape=list(metrics.output_shape),
            labelled=metrics.labelled, prediction_change=metrics.prediction_change,
            kl_divergence=metrics.kl_divergence, before=Scores.of(metrics.before), after=Scores.of(metrics.after),
            note=metrics.note, seconds=seconds, collectives=1, runtime=runtime,  # type: ignore[arg-type]
        )


class InputFile(ReportPart):
    """An uploaded input of a job: its file name and blob digest."""

    filename: str | None
    digest: str | None


class Versions(ReportPart):
    """The software that wrote the report."""

    bnrecal: str
    torch: str
    python: str


class JobSection(ReportPart):
    """What names a server job in its report (``job``)."""

    id: str
    submitted_at: str
    written_at: str
    inputs: dict[str, InputFile]
    versions: Versions
    hosts: dict[str, str]


class Report(ReportPart):
    """The run report: built once by the run core; the phases after the statistics set their
    own section (``onnx``, ``int8``, ``evaluation``, ``job``...). Read it by attribute
    (``report.layers[0].name``) or by its JSON keys (``report["layers"][0]["name"]``)."""

    OMIT_WHEN_NONE = frozenset({"convergence", "decoding", "model", "data", "program", "evaluation", "onnx", "int8",
                                "openvino", "openvino_int8", "job"})

    arch: str | None
    mode: str
    world_size: int
    backend: str
    device: str
    batch_size: int
    samples: int
    steps: int
    collectives: int
    collectives_per_rank: list[int]
    seconds: float
    samples_per_second: float | None
    nodes: list[str]
    memory_formats: list[str]
    placement: str
    data_transport: str
    object_store_bytes: int
    attempts: int
    retried_failures: list[str]
    cpus_per_worker: float
    dataset: DatasetReport
    layers: list[LayerReport]
    skipped: list[SkippedLayerReport]
    embedded_cluster: bool
    order: str
    seed: int | None
    standard_error_max: WorstError | None
    convergence: Convergence | None = None
    timeline: list[TimelineEntry] = Field(default_factory=list)
    decoding: DecodingReport | None = None
    model: ModelSection | None = None
    data: DataSummary | None = None
    program: ProgramSection | None = None
    evaluation: EvaluationSection | None = None
    onnx: OnnxSection | None = None
    int8: Int8Section | None = None
    openvino: OpenVinoSection | None = None
    openvino_int8: OpenVinoSection | None = None
    job: JobSection | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        """A report read back from its JSON (a server job's ``report``)."""
        return cls.model_validate(data)


def build_report(
    options: RunOptions,
    result: GroupResult,
    layers: Sequence[LayerDrift],
    skipped: Sequence[SkippedLayer],
    placement: Placement,
    dataset: Any,
    attempts: Sequence[str] = (),
) -> Report:
    """The run report (see docs/report.md): the options, what the ranks did, where, and per
    layer how far its statistics moved. ``attempts`` are the messages of the failed passes
    that were retried; ``dataset`` the data as described (a file's or the caller's)."""
    entries = [layer_entry(drift) for drift in layers]
    worst = worst_standard_error(entries)
    order = getattr(dataset, "order", "given")
    convergence = None
    if getattr(options, "max_samples", None) == AUTO:
        reached = result.convergence
        convergence = Convergence(
            tolerance=options.stop_tolerance, converged=reached is not None and reached.converged,
            samples=result.samples, available_samples=dataset.num_samples, steps=result.steps,
            min_steps=reached.min_steps if reached is not None else None, worst=worst,
        )
    return Report(
        arch=options.arch,
        mode=options.mode,
        world_size=options.workers,
        backend=placement.backend,
        device=options.device,
        batch_size=options.batch_size,
        samples=result.samples,
        steps=result.steps,
        collectives=result.collectives[0],
        collectives_per_rank=list(result.collectives),
        seconds=round(result.seconds, 6),
        samples_per_second=round(result.samples / result.seconds, 3) if result.seconds > 0 else None,
        nodes=list(result.nodes),
        memory_formats=list(result.memory_formats),
        placement=placement.placement,
        data_transport=placement.data_transport,
        object_store_bytes=placement.object_store_bytes,
        attempts=len(attempts) + 1,
        retried_failures=list(attempts),
        cpus_per_worker=placement.cpus_per_worker,
        dataset=DatasetReport(kind=dataset.kind, samples=dataset.num_samples, sample_shape=list(dataset.sample_shape)),
        layers=entries,
        skipped=[SkippedLayerReport(name=s.name, reason=s.reason) for s in skipped],
        embedded_cluster=placement.embedded_cluster,
        order=order,
        seed=getattr(dataset, "seed", 0) if order == "shuffled" else None,
        standard_error_max=worst,
        convergence=convergence,
    )


def worst_standard_error(layers: Sequence[LayerReport]) -> WorstError | None:
    """The layer and statistic with the largest standard error (worst channel): ``mean``
    (std units) or ``variance`` (relative); None without standard errors (fewer than two steps)."""
    worst: WorstError | None = None
    for entry in layers:
        for statistic, value in (("mean", entry.se_mean_max), ("variance", entry.se_var_max)):
            if value is not None and (worst is None or value > worst.error):
                worst = WorstError(layer=entry.name, statistic=statistic, error=value)
    return worst


def layer_entry(drift: LayerDrift) -> LayerReport:
    """How far one layer's statistics moved, and how precisely they are known.

    ``mean_shift`` is the largest channel's mean change in units of its old standard
    deviation; ``var_ratio_max`` and ``var_ratio_min`` the largest and smallest new/old
    variance ratio over channels (None where an old variance was zero), so a channel that
    shrank is visible beside one that grew. The standard errors of the new mean (std units)
    and variance (relative), worst and median channel, are None when not estimated.
    """
    layer = drift.layer
    new_mean = layer.running_mean.detach().double().cpu()
    new_var = layer.running_var.detach().double().cpu()
    old_mean, old_var = drift.old_mean.double().cpu(), drift.old_var.double().cpu()
    shift = ((new_mean - old_mean).abs() / torch.sqrt(old_var + layer.epsilon)).max().item()
    ratio_max = ratio_min = None
    if bool((old_var > 0).all()):
        ratios = new_var / old_var
        ratio_max, ratio_min = ratios.max().item(), ratios.min().item()
    return LayerReport(
        name=layer.name, class_name=layer.class_name, channels=layer.channels, calls=drift.calls,
        mean_shift=_finite(shift), var_ratio_max=_finite(ratio_max), var_ratio_min=_finite(ratio_min),
        **standard_errors(drift.stats),
    )


def standard_errors(stat: MomentStats | None) -> dict[str, float | None]:
    """Worst and median channel of a layer's standard errors (None when not estimated)."""
    entries: dict[str, float | None] = dict.fromkeys(("se_mean_max", "se_mean_median", "se_var_max", "se_var_median"))
    if stat is None or stat.se_mean is None or stat.se_var is None or not stat.se_mean.numel():
        return entries
    for name, values in (("se_mean", stat.se_mean), ("se_var", stat.se_var)):
        values = values.double().cpu()
        entries[f"{name}_max"] = _finite(float(values.max().item()))
        entries[f"{name}_median"] = _finite(float(values.median().item()))
    return entries


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def write_report(report: ReportPart, path: str | os.PathLike[str]) -> None:
    """Write the report (or a part of it, such as ``bnrecal export``'s smaller report) as
    indented JSON, atomically."""
    data = report.to_dict()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    atomic_write(target, lambda temp: temp.write_text(text))
