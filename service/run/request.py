"""What a recalibration of files is: the request (run options, the checkpoint or program,
the data as paths or URIs) and the finished :class:`Recalibration`, with the evaluation
planned on the driver. The run itself is ``service.run.recalibrate``; the export phases
(``service.run.outputs.later_phases``, ``exporting``, ``int8``) read these types.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import Field, StrictInt, field_validator, model_validator
from torch import nn

from bnrecal.errors import DatasetOptionError, Int8GuardError
from bnrecal.workers.data import (
    DatasetSpec, ReadOptions, columned, describe_dataset, detect_format, format_named, read_labels,
)
from bnrecal.workers.data.storage.objectstore import is_data_uri
from bnrecal.workers.models.checkpoints import Checkpoint
from bnrecal.workers.ranks.plan import EvalPlan

from bnrecal.service.run.model_source import LoadedModel
from bnrecal.service.run.options import RunOptions, check_model_choice
from bnrecal.service.run.report.document import Report, write_report
from bnrecal.service.run.shared import DescribedSet
from bnrecal.service.settings import Settings

if TYPE_CHECKING:
    from bnrecal.service.export.graph_reuse import TraceAhead
    from bnrecal.service.run.shared import SharedRanks


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
    evaluation: EvalPlan | None = None
    int8_failed: Int8GuardError | None = None
    """Set when the INT8 file failed its guard: the other outputs were written, the report's
    ``int8`` section says why (docs/int8.md); a surface raises it once they are kept."""
    head: torch.Tensor | None = None
    """The first calibration samples, as the ranks read them (``LaterPhases.head``)."""
    read_here: int = 0
    """Calibration samples this process read itself (an export the run did not plan for)."""
    evaluation_later: bool = False
    """The evaluation before and after is left to the INT8 export's passes (``LaterPhases.evaluation_later``)."""
    scope: str | None = None
    """The run's scope on its ranks (``RunResult.scope``): its exports keep their trace there."""
    traced: TraceAhead | None = None
    """The exporter's trace its host made while the ranks computed the statistics, for its
    exports to reuse (``service.run.recalibrate.trace_ahead``); None: the exports trace."""

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
        stale = copy.deepcopy(self.model)
        state = stale.state_dict()
        for key, value in self.stale_buffers.items():
            state[key].copy_(value)
        return stale

    def calibration_samples(self, count: int) -> torch.Tensor:
        """The first ``count`` calibration samples, to verify an export: those the ranks read
        first and handed back where the run asked for them (``head``: its own exports), so
        the driver reads none; else read here (counted in ``read_here``)."""
        wanted = min(count, self.dataset.num_samples)
        if self.head is not None and len(self.head) >= min(wanted, int(self.report["samples"])):
            return self.head[:count]
        self.read_here = max(self.read_here, wanted)
        with self.dataset.open() as data:
            return data.load(0, wanted)


def check_columns_used(request: RunOptions, data: DatasetSpec, evaluation: DatasetSpec | None) -> None:
    """Refuse a column name that names no column: ``image_column`` without shards whose
    samples sit in columns (Parquet, Arrow, MDS), ``label_column`` without such evaluation
    data (the options apply to whichever data set is columnar, docs/data.md)."""

    def columnar(spec: DatasetSpec | None) -> bool:
        return spec is not None and spec.shards is not None and spec.shards.kind.columns

    formats = columned("or")
    if request.image_column is not None and not (columnar(data) or columnar(evaluation)):
        raise DatasetOptionError(
            f"image_column names a {formats} column; neither the data nor the evaluation data is {formats}",
            field="image_column",
        )
    if request.label_column is not None and not columnar(evaluation):
        raise DatasetOptionError(
            f"label_column names the labels of {formats} evaluation data; "
            + ("there is no evaluation data" if evaluation is None else f"the evaluation data is not {formats}"),
            field="label_column",
        )


def plan_evaluation(
    request: RecalibrationRequest, settings: Settings, shared: SharedRanks | None = None,
) -> EvalPlan:
    """Describe the evaluation data, read its labels and its first sample: the probe on which
    the run checks that the model's output can be evaluated (``service.run.core``: on the
    driver before any rank starts, or a sweep's cell on its ranks). A sweep's cells
    (``shared``) describe the data and read its labels and sample once."""
    assert request.eval_data is not None
    source = request.eval_data
    # The transform is for images: evaluation arrays beside calibration images are fed as they are.
    if isinstance(source, str):  # object storage: arrays by their extension
        named = format_named(source.rsplit("/", 1)[-1])
        arrays = named is not None and named.reads_as == "arrays"
    else:
        arrays = source.is_file() and detect_format(source, "evaluation data", request.eval_data_name).reads_as == "arrays"
    read = ReadOptions(
        transform=None if arrays else request.transform,
        max_samples=request.eval_max_samples,
        role="evaluation data",
        name=request.eval_data_name,
        image_column=request.image_column,
        label_column=request.label_column,
        columns_elsewhere="ignore",
    )

    def describe() -> DescribedSet:
        dataset = describe_dataset(source, read, settings.data_access())
        with dataset.open() as data:
            return DescribedSet(dataset, data.load(0, 1), read_labels(dataset))

    described = describe() if shared is None else shared.described(f"evaluation|{source}|{read!r}", describe)
    return EvalPlan(dataset=described.dataset, labels=described.labels, target=None, batch_size=request.batch_size,
                    probe=described.first.clone())  # the model may write into its input
