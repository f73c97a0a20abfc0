"""A recalibration of files: a checkpoint (or program) and data given as paths, for the
command line and the job server.

It validates everything it can on the driver first (architecture and checkpoint, or
program; data; that the model accepts the data) so bad input fails in seconds with a
clear error, then runs the one run core (``service.run.core``) and keeps what the files
need: the statistics go into the checkpoint in its uploaded format and layout, or into
the same program archive.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field, StrictInt, field_validator, model_validator
from torch import nn

from bnrecal.workers.data import DatasetSpec, describe_dataset, detect_format, read_labels
from bnrecal.workers.data.objectstore import is_data_uri
from bnrecal.workers.engine.batchnorm import find_batchnorm_layers
from bnrecal.workers.engine.evaluation import check_eval_output
from bnrecal.errors import NoBatchNormError
from bnrecal.workers.models.checkpoints import Checkpoint
from bnrecal.workers.ranks.plan import EvalPlan

from bnrecal.service.run.core import Executor, FailurePolicy, ProgressCallback, RunPlan, run
from bnrecal.service.run.executors import (  # noqa: F401 - also the INT8 range pass's and the runner's
    InProcess,
    RayRanks,
    cpus_per_worker,
    group_options,
    resolve_data_transport,
    ship_rank_shards,
)
from bnrecal.service.run.model_source import LoadedModel, load_model
from bnrecal.service.run.options import RunOptions, check_model_choice
from bnrecal.service.run.report import Report, write_report
from bnrecal.service.settings import Settings

if TYPE_CHECKING:  # Ray is imported where a run uses it: a one-worker run in this process never does
    from bnrecal.workers.ranks.pool import WarmPool


class RecalibrationRequest(RunOptions):
    """The run options, with the checkpoint (or program) and data as local paths: what
    ``recalibrate`` takes. A program replaces ``arch``, ``model_kwargs`` and ``checkpoint``.

    With ``eval_data`` the model is evaluated before and after on it (report ``evaluation``).
    The ``*_name`` fields are what messages and the report call each file instead of its
    own name: the service stores uploads under their digest and passes the names they
    were uploaded with (only shown, never used as paths).
    """

    checkpoint: Path | None = None
    program: Path | None = None
    data: Path | str
    eval_data: Path | str | None = None
    eval_max_samples: StrictInt | None = Field(default=None, ge=1, le=2**53)
    checkpoint_name: str | None = None
    program_name: str | None = None
    data_name: str | None = None
    eval_data_name: str | None = None

    @field_validator("data", "eval_data", mode="before")
    @classmethod
    def _path_unless_uri(cls, value: object) -> object:
        """Data is a local path, or kept as written when it is a URI (``s3://...``)."""
        if isinstance(value, str) and not is_data_uri(value):
            return Path(value)
        return value

    @model_validator(mode="after")
    def _one_model(self) -> RecalibrationRequest:
        """An architecture with a checkpoint, or a program: exactly one model."""
        check_model_choice(self.arch, self.checkpoint, self.program, self.model_kwargs)
        return self


@dataclass
class Recalibration:
    """A finished recalibration: the updated model, its buffer updates and the report."""

    model: nn.Module
    loaded: LoadedModel
    updates: dict[str, torch.Tensor]
    dataset: DatasetSpec
    report: Report
    stale_buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The checkpoint as uploaded (None for a program)."""
        return self.loaded.checkpoint

    def save_model(self, path: str | os.PathLike[str]) -> None:
        """Write the recalibrated checkpoint in the uploaded format and layout, or the
        recalibrated program (the same archive with new running buffers)."""
        self.loaded.save(self.updates, path)

    def save_report(self, path: str | os.PathLike[str]) -> None:
        """Write ``report.json``."""
        write_report(self.report, path)

    def stale_model(self) -> nn.Module:
        """A copy of the model with its BN statistics as they were before the recalibration
        (to show what recalibrating bought, e.g. in INT8)."""
        import copy

        stale = copy.deepcopy(self.model)
        state = stale.state_dict()
        for key, value in self.stale_buffers.items():
            state[key].copy_(value)
        return stale

    def calibration_samples(self, count: int) -> torch.Tensor:
        """The first ``count`` calibration samples, e.g. to verify an export."""
        with self.dataset.open() as data:
            return data.load(0, min(count, self.dataset.num_samples))


def recalibrate(
    request: RecalibrationRequest,
    settings: Settings,
    *,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    pool: WarmPool | None = None,
    in_process: bool = False,
) -> Recalibration:
    """Recompute every BN layer's running statistics of a checkpoint (or program) on Ray actors.

    The files' side of the one run core (``service.run.core``): load the model, describe
    and probe the data, plan the evaluation, then ``run`` it. With a ``pool`` (the
    server's), the ranks are warm actors of an earlier job of the same shape when there are
    some, and stay warm for the next one. With ``in_process`` (``bnrecal calibrate
    --workers 1`` without a Ray address) the one rank runs in this process, without Ray.
    """
    loaded = load_model(
        settings, arch=request.arch, model_kwargs=request.model_kwargs, checkpoint=request.checkpoint,
        checkpoint_name=request.checkpoint_name, program=request.program, program_name=request.program_name,
    )
    model = loaded.model
    if not find_batchnorm_layers(model)[0]:  # before the data is read: nothing to do
        skipped = find_batchnorm_layers(model)[1]
        detail = f" ({len(skipped)} without running statistics)" if skipped else ""
        raise NoBatchNormError(f"{loaded.label} has no BatchNorm layer to recalibrate{detail}")
    dataset = describe_dataset(
        request.data,
        transform=request.transform,
        max_samples=request.sample_limit,
        **settings.unpack_options(),
        name=request.data_name,
        endpoint_url=settings.s3_endpoint_url,
        order=request.order,
        seed=request.seed,
    )
    with dataset.open() as data:
        probe = data.load(0, 1)
    evaluation = _plan_evaluation(request, model, settings) if request.eval_data is not None else None
    plan = RunPlan(
        model=model, source=loaded.source, weights=loaded.weights, label=loaded.label, data=dataset, probe=probe,
        options=request, evaluation=evaluation, memory_format=settings.memory_format,
    )
    if in_process and request.workers != 1:
        raise ValueError("a run in the calling process has one worker")
    executor: Executor = (
        InProcess() if in_process
        else RayRanks(settings, address=settings.ray_address, pool=pool, placement=request.placement)
    )
    retries = settings.max_retries if request.max_retries is None else request.max_retries
    result = run(plan, executor, policy=FailurePolicy(retries), on_progress=on_progress, cancel=cancel)
    if loaded.is_program:
        result.report.program = {"name": loaded.source.name, "batch": model.batch.describe()}  # type: ignore[union-attr]
    return Recalibration(model, loaded, result.updates, dataset, result.report, result.stale_buffers)


def _plan_evaluation(request: RecalibrationRequest, model: nn.Module, settings: Settings) -> EvalPlan:
    """Describe the evaluation data, read its labels and check on one sample, on the driver,
    that the model's output can be evaluated: a problem fails here, before any actor starts."""
    assert request.eval_data is not None
    source = request.eval_data
    # The transform is for images: evaluation arrays beside calibration images are fed as they are.
    if isinstance(source, str):  # object storage: arrays by their extension
        arrays = source.lower().endswith((".npy", ".npz"))
    else:
        arrays = source.is_file() and detect_format(source, "evaluation data", request.eval_data_name) in ("npy", "npz")
    dataset = describe_dataset(
        source,
        transform=None if arrays else request.transform,
        max_samples=request.eval_max_samples,
        **settings.unpack_options(),
        role="evaluation data",
        name=request.eval_data_name,
        endpoint_url=settings.s3_endpoint_url,
    )
    labels = read_labels(dataset)
    with dataset.open() as data:
        target = check_eval_output(model, data.load(0, 1), labels)
    return EvalPlan(dataset=dataset, labels=labels, target=target, batch_size=request.batch_size)


plan_evaluation = _plan_evaluation
"""The evaluation data described and checked on the driver (also for the INT8 export's accuracy)."""


def rank_resources(settings: Settings, options: RunOptions) -> tuple[float, float]:
    """CPUs and GPUs each rank of a job asks Ray for (the runner counts them the same way)."""
    gpus = settings.gpus_per_worker if options.device == "cuda" else 0.0
    return cpus_per_worker(settings, options.workers), gpus
