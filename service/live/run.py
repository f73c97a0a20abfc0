"""``bnrecal.recalibrate``: recalibrate a caller's live model in place, here or on Ray.

The caller's side of the one run core (``service.run.core``): describe the data, decide
where the pass runs and how the model gets there (``model.py``), then ``run`` it, in this
process for one worker without a Ray cluster (no Ray imported), else on the same rank
group as every recalibration. The statistics go into the model's own BN buffers, as
``torch.optim.swa_utils.update_bn`` does, and nothing else of it changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bnrecal.workers.data import DatasetSpec
from bnrecal.workers.data.formats.loader import LoaderSpec, call_model, check_splittable, model_input
from bnrecal.workers.engine.batchnorm import require_batchnorm_layers
from bnrecal.errors import ModelInputError, SpecError, first_line
from bnrecal.workers.ranks.gangs.warm_context import current_pool

from bnrecal.service.run.core import (
    Executor, FailurePolicy, KeepBudget, LaterPhases, ProgressCallback, RunControl, RunPlan, SharedScope, run,
)
from bnrecal.service.run.executors import InProcess, ProcessGroupRanks, RayRanks
from bnrecal.service.run.options import AUTO, STARTING_PHASE, RecalibrationOptions, RunOptions
from bnrecal.service.run.progress import progress_bar
from bnrecal.service.run.report.document import DataSummary

from ..settings import Settings
from .data import PROBE_SAMPLES, describe_python_data, first_batch
from .model import ShippedModel, cannot_send, pickle_problem, run_here, ship_model
from .process_group import agreed_report, fail_together, job_group, unwrapped
from .report import RecalibrationReport

if TYPE_CHECKING:
    from bnrecal.workers.ranks.gangs.pool import WarmPool

Forward = Callable[[nn.Module, Any], Any]

def recalibrate(
    model: nn.Module | torch.export.ExportedProgram,
    data: Any,
    options: RecalibrationOptions | None = None,
    *,
    forward: Forward | None = None,
    ray_address: str | None = None,
    server: str | None = None,
    api_key: str | None = None,
    progress: bool = True,
    process_group: Any = None,
    **overrides: Any,
) -> RecalibrationReport:
    """Recompute every BatchNorm layer's running statistics of ``model`` in place, like
    ``torch.optim.swa_utils.update_bn(loader, model)``, and return the report.

    ``running_mean`` becomes the mean and ``running_var`` the unbiased variance of every
    value each BN layer sees over the whole data (exact population statistics, not an
    average of batch statistics); ``num_batches_tracked`` grows by the number of steps.
    Every other tensor is unchanged; every other module runs in eval mode (dropout off).

    data: a ``DataLoader`` (its batches are the global steps; over a map-style dataset
        each rank decodes only its part of each step with its own DataLoader, so the
        dataset must pickle; an iterable-style one is read on the driver), a map-style
        ``Dataset`` (or a tensor of samples) with ``batch_size``, any other iterable of
        batches (read on the driver and sent to the ranks), or a path or ``s3://`` URI
        (what ``bnrecal calibrate --data`` takes; ``batch_size`` defaults to 32).
        A batch is a tensor, or a tuple or list whose first element is the input (a
        tensor, or a list of per-sample tensors: detection-style batches are split by
        sample); anything else (a dict...) needs ``forward``. Shapes may vary between steps.
    options: a ``bnrecal.RecalibrationOptions``, every option below in one object; keywords
        given beside it (``workers=2``) override its fields (docs/python.md, "Options").
    workers: ranks K; each takes its ``numpy.array_split`` part of every step. With 1 and
        no ``ray_address``, ``RAY_ADDRESS`` or ``server`` the call runs in this process,
        without Ray.
    mode: ``sync`` (statistics of the whole global batch, SyncBN semantics; the result
        does not depend on K) or ``local`` (each rank's own slice).
    max_samples: use only the first M samples, or ``"auto"``: stop once every layer's
        standard errors are below ``tolerance`` (default 0.05; sync mode only).
    order, seed: the order a path's samples are read in (``shuffled`` with ``seed``, or
        ``given``); data in memory keeps its own order, as with ``update_bn``.
    image_column: Parquet or Arrow data (a path, a URI or a list of shard URLs): the column
        of encoded images (default ``image``, or the one column holding image bytes).
    transform: image data given as a path: the transform its images are read with
        (``{"resize": 256, "crop": 224}``, as ``--transform``).
    placement, max_retries: where Ray places the ranks (``spread`` or ``pack``) and how
        often a failed pass is run again (default: the settings, ``BNRECAL_MAX_RETRIES``).
    device: where the ranks compute (``cpu`` or ``cuda``).
    forward: ``forward(model, batch)`` feeds the model a batch (e.g. ``model(**batch)``);
        with it the model travels pickled (see below), never as a program. A model that
        computes in float64 or float16 needs it (a tensor input is fed as float32).
    ray_address: the Ray cluster to run on (else ``RAY_ADDRESS``, else an embedded local
        instance, shut down again after the call; a cluster the caller joined stays).
    server, api_key: run as a job of the bnrecal server at this URL instead: the model
        goes as a program (it must export), the data as ``.npy`` (see ``docs/python.md``).
    process_group: inside a ``torch.distributed`` job (DDP, torchrun), the group whose ranks
        all make this call, each with its data (its DataLoader over its shard; a path or a
        map-style Dataset every rank gives alike is split between them): each BN call's
        moments are combined over the group, and every rank ends with the same statistics
        and report. Nothing is started (docs/training.md).
    progress: a progress bar on a terminal; ``False`` for none.

    The service's settings (``BNRECAL_MAX_RETRIES``, ``BNRECAL_DATA_DIR``, ...) come from
    the environment, as for the command line (docs/python.md, "Where it runs, and how the model gets there").

    Only the BN statistics of ``model`` change: the pass runs on a view of it (module
    objects of its own over the same weights), never on the caller's modules, so their
    ``training`` flags, attributes, hooks, dtypes and devices stay as they were. On an
    embedded Ray the model travels pickled; on a cluster the caller joined, as a
    ``torch.export`` program of the view when it exports (no code needed on the nodes),
    else pickled with its class by reference (see ``docs/python.md``). Errors are
    ``bnrecal.BnrecalError`` subclasses with one-line messages.
    """
    pool, asked = current_pool(), live_options(options, overrides, "recalibrate")
    settings, options = call_settings(asked), run_options(asked)
    group = job_group(process_group, data, asked, ray_address=ray_address, server=server)
    if group is not None:
        try:
            return _in_group(unwrapped(model), data, asked, options, forward, progress, group)
        except BaseException as error:
            fail_together(group, error)
            raise
    if isinstance(model, nn.Module):  # before any export
        require_batchnorm_layers(model, f"model {type(model).__name__}")
    if server is not None:
        from .remote import recalibrate_on_server

        return recalibrate_on_server(
            model, data, server=server, api_key=api_key, options=options, asked=asked, forward=forward,
            progress=lambda label: progress_display(progress, label),
        )
    prepared = prepare_data(data, asked, options, forward, settings)
    here = runs_here(options, pool, ray_address)
    executor: Executor = InProcess() if here else RayRanks(
        settings, address=ray_address, pool=pool, stop_embedded=True, placement=options.placement,
    )
    with progress_display(progress) as update:
        report, _ = run_live(model, prepared, LiveRun(forward, settings, executor, here, ray_address), update)
    return report


def _in_group(
    model: Any, data: Any, asked: RecalibrationOptions, options: RunOptions, forward: Forward | None,
    progress: bool, group: ProcessGroupRanks,
) -> RecalibrationReport:
    """``recalibrate`` as one rank of the caller's group: here, its moments combined over
    the group, no retries (a rank cannot re-run a pass the others have left)."""
    if isinstance(model, nn.Module):
        require_batchnorm_layers(model, f"model {type(model).__name__}")
    settings = call_settings(asked).model_copy(update={"max_retries": 0})
    prepared = prepare_data(data, asked, options, forward, settings)
    shown = progress and group.collective.rank == 0
    with progress_display(shown) as update:
        report, _ = run_live(model, prepared, LiveRun(forward, settings, group, True), update)
    return agreed_report(report, group, own_data=not group.split)


def live_options(options: RecalibrationOptions | None, overrides: Mapping[str, Any], call: str) -> RecalibrationOptions:
    """A call's options: ``options`` with the keywords given beside it in place of its
    fields, checked (a bad value names its keyword; an unknown keyword is a ``TypeError``,
    as Python's own)."""
    if options is not None and not isinstance(options, RecalibrationOptions):
        raise TypeError(f"{call}() options must be a bnrecal.RecalibrationOptions, not {type(options).__name__}")
    unknown = sorted(set(overrides) - set(RecalibrationOptions.model_fields))
    if unknown:
        raise TypeError(f"{call}() got an unexpected keyword argument {unknown[0]!r} (its options are "
                        f"bnrecal.RecalibrationOptions' fields: {', '.join(RecalibrationOptions.model_fields)})")
    given = {**(options.explicit() if options is not None else {}), **overrides}
    for name in ("workers", "batch_size", "seed", "max_retries"):  # numpy integers are counts too
        if given.get(name) is not None:
            given[name] = _count(given[name], name)
    if given.get("max_samples") not in (None, AUTO):
        given["max_samples"] = _count(given["max_samples"], "max_samples")
    if given.get("label_column") is not None:
        raise SpecError(f"label_column names the labels of evaluation data, which {call} does not take",
                        field="label_column")
    return RecalibrationOptions.checked(**given)


def run_options(asked: RecalibrationOptions) -> RunOptions:
    """The options as the run core takes them: a count of samples is applied where the data
    is described (``prepare_data``), so the run itself reads all of what it is given."""
    return RunOptions.checked(**{**asked.explicit(), "max_samples": AUTO if asked.auto_samples else None})


def call_settings(asked: RecalibrationOptions) -> Settings:
    """The service's settings (from the environment), with a call's ``max_retries`` in place."""
    settings = Settings()
    if asked.max_retries is not None:
        settings = settings.model_copy(update={"max_retries": asked.max_retries})
    return settings


@dataclass(frozen=True)
class PreparedData:
    """A caller's data described once for the runs over it: the description, the probe batch
    (as the ranks feed it) and the run options (a DataLoader's batches set the batch size)."""

    spec: DatasetSpec | LoaderSpec
    sample: Any
    options: RunOptions


def prepare_data(
    data: Any, asked: RecalibrationOptions, options: RunOptions, forward: Forward | None, settings: Settings,
) -> PreparedData:
    """Describe the caller's data as ``asked`` (its batch size where one was given, its count
    of samples, its order and columns) and read its probe batch (docs/python.md, "Data")."""
    spec = describe_python_data(
        data, batch_size=asked.batch_size if "batch_size" in asked.model_fields_set else None,
        max_samples=asked.max_samples, select_input=forward is None, settings=settings, order=asked.order,
        seed=asked.seed, image_column=asked.image_column, transform=asked.transform,
    )
    sample = _probe_batch(spec, forward)
    if isinstance(spec, LoaderSpec):
        options = options.model_copy(update={"batch_size": max(spec.sizes)})
    return PreparedData(spec, sample, options)


def runs_here(options: RunOptions, pool: WarmPool | None, ray_address: str | None) -> bool:
    """Whether the pass runs in this process, without Ray: one worker, no pool, no cluster asked for."""
    return options.workers == 1 and pool is None and not ray_address and not os.environ.get("RAY_ADDRESS")


@dataclass(frozen=True)
class LiveRun:
    """Where a live model's run goes: the caller's ``forward``, the settings, the executor
    (``here``: in this process), the Ray address asked for, and a sweep's shared scope."""

    forward: Forward | None
    settings: Settings
    executor: Executor
    here: bool
    ray_address: str | None = None
    shared: SharedScope | None = None
    keep: KeepBudget = KeepBudget(0, 0)  # one pass: nothing read again, decodes counted


def run_live(
    model: nn.Module | torch.export.ExportedProgram, data: PreparedData, where: LiveRun,
    on_progress: ProgressCallback,
) -> tuple[RecalibrationReport, dict[str, torch.Tensor]]:
    """Recalibrate ``model`` in place over prepared data: ship it (or run on a view of it
    here), run the one run core, write the statistics back; the report and the BN buffers
    written (by the model's keys)."""
    spec, sample, options, forward = data.spec, data.sample, data.options, where.forward
    feed = forward if forward is not None or isinstance(sample, torch.Tensor) else call_model
    if where.here:
        shipped = run_here(model, options.device)
    else:
        _check_split(spec)
        _refuse_unsendable(spec, feed)
        shipped = ship_model(model, sample, forward, prefer=_transport(spec, forward, where.ray_address))
    plan = RunPlan(
        model=shipped.driver, source=shipped.source, weights=shipped.weights, label=f"model {type(model).__name__}",
        data=spec, probe=sample, options=options, feed=feed,
        # the model itself (it does not deep-copy) keeps its parameters' layout: no channels-last round trip
        memory_format="contiguous" if shipped.restore is not None else where.settings.memory_format,
        release=shipped.restore, later=LaterPhases(keep=where.keep, shared=where.shared),
    )
    try:
        result = run(plan, where.executor, RunControl(FailurePolicy(where.settings.max_retries)), on_progress)
    except ModelInputError as exc:
        raise _dtype_advice(model, sample, forward) or exc from None
    except TypeError as exc:  # Ray could not pickle the model or the data for the ranks
        if "serialize" not in str(exc):
            raise
        raise _not_picklable(shipped, spec, plan.feed, exc) from None
    updates = result.updates
    if shipped.write_back is not None:
        shipped.write_back(updates)
    report = result.report
    report.model = shipped.describe()
    report.data = DataSummary.of(spec.summary())
    return RecalibrationReport.of(report), updates


def _transport(spec: DatasetSpec | LoaderSpec, forward: Forward | None, ray_address: str | None) -> str:
    """How the model should reach the ranks, decided before any starts: pickled for an
    embedded Ray started for this call (this machine, the driver's ``sys.path``) and for
    batches whose shapes vary; as a program (no code needed on the nodes) on a cluster the
    caller joined, when it exports."""
    import ray

    from bnrecal.service.run.cluster import EMBEDDED_ADDRESSES

    joined = ray.is_initialized() or (ray_address or os.environ.get("RAY_ADDRESS") or "") not in EMBEDDED_ADDRESSES
    if not joined or forward is not None:
        return "pickle"
    if isinstance(spec, LoaderSpec) and spec.kind == "batches" and spec.select_input:
        shapes = {_input_shape(batch) for batch in spec.batches}
        if len(shapes) > 1:
            return "pickle"
    return "program"


def _input_shape(batch: Any) -> tuple[int, ...] | None:
    value = model_input(batch)
    return tuple(value.shape[1:]) if isinstance(value, torch.Tensor) else None


def _check_split(spec: DatasetSpec | LoaderSpec) -> None:
    """Batches read on the driver are split between the ranks: each must split by sample."""
    if isinstance(spec, LoaderSpec) and spec.kind == "batches":
        for batch in spec.batches:
            check_splittable(batch)


def _dtype_advice(model: Any, sample: Any, forward: Forward | None) -> SpecError | None:
    """Where a model that rejects the data computes in another dtype than float32 (a tensor
    input is fed as float32), the error that says to give ``forward``."""
    if forward is not None or not isinstance(model, nn.Module) or not isinstance(sample, torch.Tensor):
        return None
    dtypes = {t.dtype for t in model.parameters() if t.is_floating_point()}
    other = sorted(str(d).replace("torch.", "") for d in dtypes - {torch.float32})
    if not other:
        return None
    return SpecError(
        f"model {type(model).__name__} computes in {', '.join(other)}, and a batch's input is fed as float32: "
        f"give forward=lambda model, batch: model(batch[0].to(torch.{other[0]})) (or however it takes a batch)",
        field="forward",
    )


def _sent_parts(spec: DatasetSpec | LoaderSpec, forward: Forward | None) -> list[tuple[str, Any]]:
    """What goes to the ranks beside the model, by the option that gives it: ``forward``,
    and a DataLoader's dataset and collate_fn (its batches read on the driver are tensors)."""
    parts: list[tuple[str, Any]] = [("forward", forward)]
    if isinstance(spec, LoaderSpec) and spec.kind == "loader":
        parts += [("data", spec.dataset), ("data", spec.collate_fn)]
    return parts


def _refuse_unsendable(spec: DatasetSpec | LoaderSpec, forward: Forward | None) -> None:
    """Refuse, before any rank starts, what cannot be pickled for the ranks (docs/python.md):
    the model is checked where it is shipped (``ship_model``)."""
    for name, value in _sent_parts(spec, forward):
        problem = pickle_problem(value)
        if problem is not None:
            raise cannot_send(name, problem)


def _not_picklable(
    shipped: ShippedModel, spec: DatasetSpec | LoaderSpec, forward: Forward | None, exc: TypeError
) -> SpecError:
    """Which of what went to the ranks could not be pickled after all, named in one line
    (what Ray failed on that the checks before the start did not see: the driver's batches)."""
    parts: list[tuple[str, Any]] = [("model", shipped.weights), *_sent_parts(spec, forward)]
    if isinstance(spec, LoaderSpec) and spec.kind == "batches":
        parts.append(("data", spec.batches))
    for name, value in parts:
        problem = pickle_problem(value)
        if problem is not None:
            return cannot_send(name, problem)
    return SpecError(f"what goes to the Ray workers cannot be pickled: {first_line(exc)}", field="data")


def progress_display(progress: bool, first_phase: str = STARTING_PHASE) -> Any:
    """The CLI's progress bar (a terminal only), or none at all: ``with`` it, the callback."""
    if progress:
        return progress_bar(first_phase)
    from contextlib import nullcontext

    return nullcontext(lambda done, total, phase="": None)


def _probe_batch(spec: DatasetSpec | LoaderSpec, forward: Forward | None) -> Any:
    """A batch of the first samples as the ranks will feed it (the model's input as float32,
    or the batch ``forward`` takes): for the probe and the export."""
    if isinstance(spec, DatasetSpec):
        with spec.open() as opened:
            return opened.load(0, min(PROBE_SAMPLES, spec.num_samples))
    batch = first_batch(spec)
    if forward is not None:
        return batch
    value = model_input(batch)
    return value.to(torch.float32) if isinstance(value, torch.Tensor) else value


def _count(value: Any, name: str) -> int:
    """An integer option as a Python int (numpy integers too), refused when it is not one."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise SpecError(f"{name} must be an integer, got {value!r}", field=name)
    return int(value.__index__())

