"""A recalibration of files: a checkpoint (or program) and data given as paths, for the
command line and the job server (``recalibrate_to_files`` is their one way from a request
to the files written).

It validates everything it can on the driver first (architecture and checkpoint, or
program; data; that the model accepts the data) so bad input fails in seconds with a
clear error, then runs the one run core (``service.run.core``) and keeps what the files
need: the statistics go into the checkpoint in its uploaded format and layout, or into
the same program archive.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bnrecal.workers.data import ReadOptions, describe_dataset
from bnrecal.workers.engine.batchnorm import require_batchnorm_layers
from bnrecal.workers.ranks.gangs.warm_context import current_pool

from bnrecal.service.run.core import (
    Executor, FailurePolicy, KeepBudget, LaterPhases, ProgressCallback, RunControl, RunPlan, check_cancel, running,
)
from bnrecal.service.run.executors import InProcess, RayRanks, cpus_per_worker
from bnrecal.service.run.model_source import load_model
from bnrecal.service.run.options import RunOptions
from bnrecal.service.run.outputs.later_phases import RunOutputs, make_outputs
from bnrecal.service.run.report.document import ProgramSection, Report
from bnrecal.service.run.shared import DescribedSet
from bnrecal.service.run.request import (  # noqa: F401 - the request and result types, where runs are
    Recalibration,
    RecalibrationRequest,
    check_columns_used,
    plan_evaluation,
)
from bnrecal.service.settings import Settings

if TYPE_CHECKING:  # Ray is imported where a run uses it: a one-worker run in this process never does
    import torch
    from torch import nn

    from bnrecal.service.export.graph_reuse import TraceAhead
    from bnrecal.service.run.model_source import LoadedModel

    from bnrecal.workers.ranks.gangs.pool import WarmPool

    from bnrecal.service.run.report.page import JobLabel
    from bnrecal.service.run.shared import SharedRanks


def recalibrate(
    request: RecalibrationRequest,
    settings: Settings,
    *,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    pool: WarmPool | None = None,
    in_process: bool = False,
    outputs: RunOutputs | None = None,
    shared: SharedRanks | None = None,
    on_statistics: Callable[[Report], None] | None = None,
) -> Recalibration:
    """Recompute every BN layer's running statistics of a checkpoint (or program) on Ray actors.
    ``on_statistics`` hears of the report once the statistics are in, before the later phases.

    The files' side of the one run core (``service.run.core``): load the model, describe
    and probe the data, plan the evaluation, then ``run`` it. With a ``pool`` (the
    server's), the ranks are warm actors of an earlier job of the same shape when there are
    some, and stay warm for the next one. With ``in_process`` (``bnrecal calibrate
    --workers 1`` without a Ray address) the one rank runs in this process, without Ray.
    ``outputs`` are the files the run makes after the statistics (the ONNX export, the
    INT8 file), later phases of the same run on its ranks (``service.run.outputs.later_phases``); an
    INT8 file that failed its guard leaves ``int8_failed`` set on the result. With
    ``shared`` (a sweep's cell) the run is on the sweep's ranks and keeps what they decode
    of the data for the sweep's next models (``service.run.shared``).
    """
    loaded = load_model(
        settings, arch=request.arch, model_kwargs=request.model_kwargs, checkpoint=request.checkpoint,
        checkpoint_name=request.checkpoint_name, program=request.program, program_name=request.program_name,
    )
    model = loaded.model
    require_batchnorm_layers(model, loaded.label)  # before the data is read: nothing to do
    read = ReadOptions(
        transform=request.transform,
        max_samples=request.sample_limit,
        name=request.data_name,
        order=request.order,
        seed=request.seed,
        image_column=request.image_column,
        columns_elsewhere="ignore",
    )

    def describe() -> DescribedSet:
        dataset = describe_dataset(request.data, read, settings.data_access())
        with dataset.open() as data:
            return DescribedSet(dataset, data.load(0, 1))

    # a sweep's cells over one set share its description and probe: a prefix of shards is listed once
    described = describe() if shared is None else shared.described(f"calibration|{request.data}|{read!r}", describe)
    dataset, probe = described.dataset, described.first.clone()  # the model may write into its input
    evaluation = plan_evaluation(request, settings, shared) if request.eval_data is not None else None
    check_columns_used(request, dataset, evaluation.dataset if evaluation is not None else None)
    later = evaluation is not None and evaluation_with_int8(outputs, model)
    ahead = None if in_process or shared is not None else trace_ahead(outputs, loaded, probe)
    plan = RunPlan(
        model=model, source=loaded.source, weights=loaded.weights, label=loaded.label, data=dataset, probe=probe,
        options=request, evaluation=evaluation, memory_format=settings.memory_format,
        later=LaterPhases(
            keep=kept_budget(settings, outputs) if shared is None else shared.keep, head=head_samples(outputs, model),
            evaluation_later=later,
            shared=None if shared is None else shared.shared_scope(str(request.data)),
            ahead=None if ahead is None else ahead.start,
        ),
    )
    if in_process and request.workers != 1:
        raise ValueError("a run in the calling process has one worker")
    executor: Executor
    if shared is not None:
        executor = shared
    elif in_process:
        executor = InProcess()
    else:
        executor = RayRanks(settings, address=settings.ray_address, pool=pool if pool is not None else current_pool(),
                            placement=request.placement)
    retries = settings.max_retries if request.max_retries is None else request.max_retries
    control = RunControl(FailurePolicy(retries), cancel)
    with running(plan, executor, control, on_progress) as result:  # the later phases run while the ranks are up
        recalibration = Recalibration(
            model, loaded, result.updates, result.data, result.report, result.stale_buffers, result.evaluation,  # type: ignore[arg-type]
            head=result.head, evaluation_later=later, scope=result.scope, traced=ahead,
        )
        if loaded.is_program:
            result.report.program = ProgramSection(name=loaded.source.name, batch=model.batch.describe())  # type: ignore[union-attr]
        if on_statistics is not None:
            on_statistics(result.report)
        if outputs is not None and outputs.any:
            make_outputs(recalibration, request, outputs, executor, control.later(), on_progress)
    return recalibration



WRITING_PHASE = "writing"


@dataclass(frozen=True)
class RunFiles:
    """What a run of files writes besides its outputs (``RunOutputs``), each where given: the
    recalibrated model in its uploaded format, ``report.json`` and ``report.html``; a server
    job's report names its job (``job``)."""

    model: Path | None = None
    report: Path | None = None
    report_html: Path | None = None
    job: JobLabel | None = None


def recalibrate_to_files(
    request: RecalibrationRequest,
    settings: Settings,
    outputs: RunOutputs,
    files: RunFiles,
    *,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    pool: WarmPool | None = None,
    in_process: bool = False,
    int8_field: str = "int8",
    shared: SharedRanks | None = None,
) -> Recalibration:
    """From a request to the files, for ``bnrecal calibrate`` and a server job alike: check
    an INT8 file's ``keep_float``/``op_types`` against the graph before any calibration
    (docs/int8.md; a ``SpecError`` names ``int8_field``), recalibrate with the ``outputs``
    as later phases of the run, then write the ``files``. An INT8 file that failed its
    guard leaves ``int8_failed`` set on the result, for the surface to raise. ``shared``: a
    sweep's cell, on the sweep's ranks (``recalibrate``); the INT8 options are the sweep's, so
    they are checked against the first cell's graph only (a typo fails the sweep's first cell
    in seconds; every cell's INT8 phase still resolves them against its own graph)."""
    checked = shared is not None and not shared.first("int8 names")
    if outputs.int8 is not None and outputs.int8_options is not None and not checked:
        from bnrecal.service.run.outputs.int8_names import check_int8_names  # the quantizer's imports: only for INT8

        check_int8_names(request, settings, outputs.int8_options, field=int8_field, opset=outputs.export.opset)
    try:
        result = recalibrate(request, settings, on_progress=on_progress, cancel=cancel, pool=pool,
                             in_process=in_process, outputs=outputs, shared=shared,
                             on_statistics=predraw_charts if files.report_html is not None else None)
    except BaseException:
        if files.report_html is not None:  # a run that fails after its statistics: its charts' thread ends first
            from bnrecal.service.run.report.charts import CHARTS

            CHARTS.settle()
        raise
    check_cancel(cancel)
    if on_progress is not None:
        on_progress(0, None, WRITING_PHASE)
    if files.model is not None:
        result.save_model(files.model)
    if files.job is not None:  # the report names its job, and the hosts its ranks ran on
        from bnrecal.service.run.report.page import job_section

        result.report.job = job_section(files.job, result.report.nodes)
    if files.report is not None:
        result.save_report(files.report)
    if files.report_html is not None:
        from bnrecal.service.run.report.page import write_html_report  # jinja2: only for the page

        write_html_report(result.report, files.report_html)  # its charts drawn after the statistics (predraw_charts)
    return result


def predraw_charts(report: Report) -> None:
    """Start drawing the report page's charts while the run's later phases keep its ranks busy
    (``report_charts.ChartMemo``): the page at the end takes them, the same bytes."""
    from bnrecal.service.run.report.page import predraw_charts as predraw  # jinja2 and matplotlib: only for the page

    predraw(report)


def trace_ahead(outputs: RunOutputs | None, loaded: LoadedModel, probe: torch.Tensor) -> TraceAhead | None:
    """The export's trace, to be made on this process while the ranks start and compute the
    statistics (docs/onnx.md, "Where the export runs"): a core is free while they start, and
    the trace does not depend on the statistics, so the ranks' exports put their weights in
    it instead of each tracing. For a run on ranks (not in this process, whose one rank is
    this process's cores) that exports a model built from code at a dynamic batch in an opset
    of torch's dynamo exporter; None otherwise (the ranks trace, as before). A program is
    traced on its ranks: its graph is rebuilt there from the archive."""
    import torch

    from bnrecal.errors import ExportError
    from bnrecal.service.export import trace_ahead as trace
    from bnrecal.service.export.opsets import DYNAMO_MAX_OPSET, DYNAMO_MIN_OPSET

    if outputs is None or not outputs.any or loaded.is_program:
        return None
    export = outputs.export
    if not export.dynamic_batch or not DYNAMO_MIN_OPSET <= export.opset <= DYNAMO_MAX_OPSET:
        return None
    if not isinstance(probe, torch.Tensor) or probe.dim() < 2:
        return None
    try:  # the model as it is now, copied by ``trace``: the run writes the new statistics into its own
        return trace(loaded.model, probe[:1].expand(2, *probe.shape[1:]).clone(), opset=export.opset,
                     input_shape=export.input_shape)
    except ExportError:  # the export refuses these options itself, in its own phase, as before
        return None


def head_samples(outputs: RunOutputs | None, model: nn.Module) -> int:
    """How many of the first samples the ranks hand back for the exports' checks: the
    verified batch, or a program's static batch where it is larger; none without an export."""
    from bnrecal.service.export.verification import VERIFY_SAMPLES

    if outputs is None or not outputs.any:
        return 0
    return max(VERIFY_SAMPLES, static_batch(model) or 0)


def evaluation_with_int8(outputs: RunOutputs | None, model: nn.Module) -> bool:
    """Whether the evaluation before and after is measured by the INT8 export's passes, on
    the folded FP32 models whose ranges they gather (the same samples read once for both,
    docs/evaluation.md), instead of beside the statistics: with an INT8 file, unless the
    model is a program of a static batch (its export runs at that batch only)."""
    return outputs is not None and outputs.int8 is not None and static_batch(model) is None


def static_batch(model: nn.Module) -> int | None:
    """The batch a program exported with a static batch runs at, else None."""
    from bnrecal.workers.programs import ProgramModule

    return model.batch.low if isinstance(model, ProgramModule) and model.batch.static else None


def kept_budget(settings: Settings, outputs: RunOutputs | None) -> KeepBudget:
    """What the ranks keep of the samples they decode: within the settings' budgets when a
    later pass reads them again (the INT8 file's range and scoring passes), else nothing
    (every decode is still counted for the report's ``decoding``)."""
    if outputs is None or outputs.int8 is None:
        return KeepBudget(0, 0)
    return KeepBudget.from_megabytes(settings.kept_memory_mb, settings.kept_disk_mb)


def rank_resources(settings: Settings, options: RunOptions) -> tuple[float, float]:
    """CPUs and GPUs each rank of a job asks Ray for (the runner counts them the same way)."""
    gpus = settings.gpus_per_worker if options.device == "cuda" else 0.0
    return cpus_per_worker(settings, options.workers), gpus
