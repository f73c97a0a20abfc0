"""The job spec as users write it: validated field by field, light to import.

A job spec (docs/api.md, "Jobs") is checked completely when it is submitted: its fields
by pydantic (a 422 names the field), the blobs it names against the tenant's store, a
server-side data path against ``BNRECAL_DATA_ROOTS``, the architecture against the
allowlist and its ranks against the cluster's nodes, so a job that is accepted can only
fail on what running it reveals (those checks: ``submission``). This module is the schema
alone, light to import: a client builds its typed spec from it without loading torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
)


from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.products import PRODUCT_NAMES, PRODUCTS
from bnrecal.service.run.options import DEFAULT_OPSET, RunOptions

from bnrecal.service.sweep.cells import NAME
from bnrecal.service.jobserver.digests import DIGEST_PATTERN

OutputName = Literal[("checkpoint", "program", *PRODUCT_NAMES)]  # type: ignore[misc]
"""What a job may make besides its report: the model in its form, and the exported files."""
ARTIFACT_NAMES = ("checkpoint", "program", *PRODUCT_NAMES, "report", "report.html")
"""A single job's artifacts; a sweep's cells have the same under ``<model>/<set>/`` (docs/sweeps.md)."""
SWEEP_ARTIFACT_NAMES = ("sweep", "sweep.csv", "sweep.html", "archive")
"""A sweep's own artifacts: the matrix report (JSON, CSV, HTML) and one archive of every file."""
MAX_SWEEP_MODELS = 1000


def is_artifact_name(name: str) -> bool:
    """Whether a job could have an artifact of this name: a single job's, a sweep's own, or a
    cell's (``<model>/<set>/<artifact>``, the names folder-safe as a sweep makes them)."""
    if name in ARTIFACT_NAMES or name in SWEEP_ARTIFACT_NAMES:
        return True
    parts = name.split("/")
    return (len(parts) == 3 and parts[2] in ARTIFACT_NAMES
            and all(NAME.match(part) and part not in (".", "..") for part in parts[:2]))


MAX_SWEEP_SETS = 100


Digest = Annotated[str, Field(pattern=DIGEST_PATTERN, examples=["sha256:" + "0" * 64])]


class DataPath(BaseModel):
    """Calibration data already on the server, under one of the operator's data roots."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        min_length=1, max_length=4096,
        description="A file or folder under BNRECAL_DATA_ROOTS, or a brace pattern of shards (train-{000..146}.tar).",
    )


class DataUri(BaseModel):
    """Calibration data in object storage, under one of the operator's allowed prefixes."""

    model_config = ConfigDict(extra="forbid")

    uri: str = Field(
        min_length=6, max_length=2048,
        description="s3://bucket/key (.npy/.npz/.zip/.tar*/.parquet), s3://bucket/prefix (images or shards) or a "
        "brace pattern of shards (s3://bucket/train-{000..146}.tar) under BNRECAL_DATA_URIS.",
    )


DataSource = Digest | DataPath | DataUri


class OnnxOptions(BaseModel):
    """How to export the folded ONNX model (with ``"onnx"`` in ``outputs``)."""

    model_config = ConfigDict(extra="forbid")

    opset: StrictInt = Field(default=DEFAULT_OPSET, ge=13, le=23, description="ONNX opset of the export.")
    dtype: Literal["float32", "float16"] = Field(default="float32", description="Float type of the graph.")
    dynamic_batch: StrictBool = Field(default=True, description="Export with a dynamic batch axis.")
    input_shape: list[StrictInt] | None = Field(
        default=None, min_length=1, max_length=8, description="Example input shape; default: the data's."
    )

    @field_validator("input_shape")
    @classmethod
    def _positive_dims(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(dim < 1 or dim > 1_000_000 for dim in value):
            raise ValueError("every dimension must be between 1 and 1000000")
        return value


class EvalSpec(BaseModel):
    """Data to evaluate the model on before and after recalibration (report ``evaluation``)."""

    model_config = ConfigDict(extra="forbid")

    data: DataSource = Field(
        description="Digest of an uploaded blob, {'path': ...} on the server or {'uri': 's3://...'}: an image folder or archive "
        "with class folders, or .npz with x and y (labelled); any calibration data format (unlabelled)."
    )
    max_samples: StrictInt | None = Field(default=None, ge=1, le=2**53, description="Use only the first M samples.")


class SweepModelSpec(BaseModel):
    """One model of a sweep: an architecture with a checkpoint, or a program."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        default=None, max_length=128,
        description="Its name in the matrix and artifact names (default: the upload's file stem, else model-<index>).",
    )
    arch: str | None = Field(default=None, max_length=512, description="Its architecture (default: the spec's arch).")
    model_kwargs: dict[str, Any] | None = Field(
        default=None, description="Keyword arguments of its factory (default: the spec's model_kwargs)."
    )
    checkpoint: Digest | None = Field(default=None, description="Digest of its uploaded checkpoint (with an arch).")
    program: Digest | None = Field(default=None, description="Digest of its uploaded torch.export program (.pt2).")


class CalibrationSetSpec(BaseModel):
    """One named calibration set of a sweep, with optional evaluation data."""

    model_config = ConfigDict(extra="forbid")

    data: DataSource = Field(description="Its calibration data, as a job's data.")
    eval: EvalSpec | None = Field(default=None, description="Evaluate each model before and after on this data.")


class JobSpec(RunOptions):
    """What to recalibrate (the run options), on what checkpoint (or program) and data, and
    which artifacts to produce."""

    checkpoint: Digest | None = Field(default=None, description="Digest of an uploaded checkpoint blob (with arch).")
    program: Digest | None = Field(
        default=None,
        description="Digest of an uploaded torch.export program (.pt2), instead of arch and checkpoint: "
        "it carries its architecture.",
    )
    data: DataSource | None = Field(
        default=None,
        description="Digest of an uploaded data blob (.npy/.npz, an image archive .tar/.zip, a WebDataset shard, "
        "a tar of shards, a Parquet file), {'path': ...} on the server, or {'uri': 's3://bucket/key-or-prefix'} in "
        "object storage; a path or URI may be a folder or prefix of shards or a brace pattern (train-{000..146}.tar)."
    )
    outputs: list[OutputName] | None = Field(  # type: ignore[valid-type]
        default=None,
        max_length=8,
        description="Artifacts to produce besides the report (default: the recalibrated checkpoint, or program): "
        + "; ".join(f"{product.name}, {product.description}" for product in PRODUCTS) + ".",
    )
    onnx: OnnxOptions = Field(default_factory=OnnxOptions, description="ONNX export options.")
    int8: Int8Options | None = Field(
        default=None, description='INT8 (QDQ) export options, with "onnx_int8" or "openvino_int8" in outputs (default: minmax).'
    )
    eval: EvalSpec | None = Field(default=None, description="Evaluate before and after on this data.")
    models: list[SweepModelSpec] | None = Field(
        default=None, min_length=1, max_length=MAX_SWEEP_MODELS,
        description="A sweep's models, in place of checkpoint or program (docs/sweeps.md); arch and model_kwargs "
        "are their defaults.",
    )
    datasets: dict[str, CalibrationSetSpec] | None = Field(
        default=None, min_length=1, max_length=MAX_SWEEP_SETS,
        description="A sweep's named calibration sets, in place of data and eval.",
    )
    pairs: list[tuple[StrictInt, str]] | None = Field(
        default=None, min_length=1, max_length=MAX_SWEEP_MODELS * MAX_SWEEP_SETS,
        description="A sweep's cells as [model index, set name] (default: every model over every set).",
    )
    cells_at_once: StrictInt = Field(
        default=1, ge=1, le=64,
        description="A sweep's cells run side by side, each on its own `workers` ranks: the sweep holds "
        "workers x cells_at_once ranks.",
    )
    rank_by: str | None = Field(
        default=None, max_length=64,
        description="The metric a sweep's matrix ranks its cells by (default: after_top1 with evaluation data, "
        "else worst_drift).",
    )

    @property
    def ranks(self) -> int:
        """The ranks the job holds: a sweep's ``workers`` for each cell it runs at once."""
        return self.workers * self.cells_at_once

    @property
    def is_sweep(self) -> bool:
        """Whether this spec is a sweep (it has models or named sets): one job over many cells."""
        return self.models is not None or self.datasets is not None

    def sweep_models(self) -> list[SweepModelSpec]:
        """A sweep's models: its ``models``, else the spec's one model."""
        if self.models is not None:
            return self.models
        return [SweepModelSpec(arch=self.arch, checkpoint=self.checkpoint, program=self.program)]

    def sweep_sets(self) -> dict[str, CalibrationSetSpec]:
        """A sweep's named sets: its ``datasets``, else the spec's data as the set ``data``."""
        if self.datasets is not None:
            return self.datasets
        assert self.data is not None
        return {"data": CalibrationSetSpec(data=self.data, eval=self.eval)}

    def input_sources(self) -> dict[str, DataSource]:
        """Every input the spec names, by field (``checkpoint``, ``models[2].checkpoint``,
        ``data``, ``datasets.cam1.eval.data``, ...): uploaded digests, paths and URIs."""
        typed: dict[str, DataSource] = {}
        for name, value in spec_inputs(self.model_dump(mode="json")).items():
            typed[name] = value if isinstance(value, str) else (DataPath if "path" in value else DataUri)(**value)
        return typed

    @field_validator("outputs")
    @classmethod
    def _unique_outputs(cls, value: list[str] | None) -> list[str] | None:
        return list(dict.fromkeys(value)) if value is not None else None

    def with_outputs(self) -> JobSpec:
        """This spec with its outputs spelled out: the model in the form it came in (the
        checkpoint, or the program) unless the submitter chose."""
        if self.outputs is not None:
            return self
        if self.is_sweep:  # each cell's model in its own form
            kinds = {"program" if model.program else "checkpoint" for model in self.sweep_models()}
            return self.model_copy(update={"outputs": [kind for kind in ("checkpoint", "program") if kind in kinds]})
        return self.model_copy(update={"outputs": ["program" if self.program else "checkpoint"]})


def spec_inputs(spec: dict[str, Any]) -> dict[str, Any]:
    """Every input a stored spec names, by field: a digest, or a ``{"path"}``/``{"uri"}`` object.
    Read from the stored JSON as it is, so the blob collector keeps a job's inputs whatever it holds."""
    def data_of(part: Any) -> Any:
        return part.get("data") if isinstance(part, dict) else None

    named: dict[str, Any] = {name: spec.get(name) for name in ("checkpoint", "program", "data")}
    named["eval.data"] = data_of(spec.get("eval"))
    models = spec.get("models")
    for index, model in enumerate(models if isinstance(models, list) else []):
        if isinstance(model, dict):
            named[f"models[{index}].checkpoint"] = model.get("checkpoint")
            named[f"models[{index}].program"] = model.get("program")
    datasets = spec.get("datasets")
    for name, calibration in (datasets.items() if isinstance(datasets, dict) else []):
        named[f"datasets.{name}.data"] = data_of(calibration)
        named[f"datasets.{name}.eval.data"] = data_of(calibration.get("eval") if isinstance(calibration, dict) else None)
    return {
        name: value for name, value in named.items()
        if isinstance(value, str) or (isinstance(value, dict) and ("path" in value or "uri" in value))
    }


def spec_digests(spec: dict[str, Any]) -> dict[str, str]:
    """The uploaded blobs a stored spec names, by field."""
    return {name: value for name, value in spec_inputs(spec).items() if isinstance(value, str)}
