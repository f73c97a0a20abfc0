"""Jobs as users see them: the validated job spec, the status set, and the job resource.

A job spec (docs/api.md, "Jobs") is checked completely when it is submitted: its fields
by pydantic (a 422 names the field), the blobs it names against the tenant's store, a
server-side data path against ``BNRECAL_DATA_ROOTS``, the architecture against the
allowlist and its ranks against the cluster's nodes, so a job that is accepted can only
fail on what running it reveals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
)

from bnrecal.workers.data.objectstore import parse_data_uri, uri_allowed
from bnrecal.workers.data.shards.listing import expand_braces, has_brace_pattern, is_manifest_name
from bnrecal.workers.data.formats.detect import array_sample_shape
from bnrecal.errors import DatasetError, InputError, SpecError
from bnrecal.workers.models.architectures import check_architecture_exists as check_reference
from bnrecal.workers.models.architectures import check_model_kwargs
from bnrecal.workers.models.model_check import check_checkpoint_fits, check_data_fits
from bnrecal.workers.programs import check_program

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.run.options import DEFAULT_OPSET, RunOptions, check_model_choice

from bnrecal.service.settings import Settings
from bnrecal.service.sweep.cells import NAME, check_name
from bnrecal.service.sweep.matrix import check_metric
from bnrecal.service.jobserver.jobs.views import Artifact, InputFile, JobStatus, JobView, PhaseEntry, PhaseTime, Progress
from bnrecal.service.jobserver.problems import Problem
from bnrecal.service.jobserver.storage.blobs import DIGEST_PATTERN, BlobStore
from bnrecal.service.jobserver.cluster.capacity import Node, check_fits_cluster

ARTIFACT_NAMES = ("checkpoint", "program", "onnx", "onnx_int8", "report", "report.html")
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
    outputs: list[Literal["checkpoint", "program", "onnx", "onnx_int8"]] | None = Field(
        default=None,
        max_length=8,
        description="Artifacts to produce besides the report (default: the recalibrated checkpoint, or program).",
    )
    onnx: OnnxOptions = Field(default_factory=OnnxOptions, description="ONNX export options.")
    int8: Int8Options | None = Field(
        default=None, description='INT8 (QDQ) export options, with "onnx_int8" in outputs (default: minmax).'
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


@dataclass(frozen=True)
class JobRecord:
    """One job as the ledger holds it (a snapshot, safe to pass between threads)."""

    id: str
    tenant: str
    status: JobStatus
    spec: dict[str, Any]
    idempotency_key: str | None
    attempts: int
    cancel_requested: bool
    samples_done: int
    samples_total: int | None
    phase: str | None
    error: Problem | None
    artifacts: dict[str, Artifact]
    report: dict[str, Any] | None
    revision: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    phases: list[PhaseEntry] = field(default_factory=list)

    def progress(self) -> Progress:
        """The job's progress as the API shows it."""
        return Progress(samples_done=self.samples_done, samples_total=self.samples_total, phase=self.phase)

    def input_digests(self) -> dict[str, str]:
        """The uploaded blobs the spec names, by field (``checkpoint``, ``data``, ``models[0].checkpoint``, ...)."""
        return spec_digests(self.spec)

    def phase_times(self) -> list[PhaseTime]:
        """Each phase of the last run with its duration: until the next phase began, the last
        one until the job finished (null while the job is still in it)."""
        times: list[PhaseTime] = []
        for index, entry in enumerate(self.phases):
            began = entry.at
            ended = self.phases[index + 1].at if index + 1 < len(self.phases) else None
            if ended is None and self.status.is_terminal:
                ended = self.finished_at
            seconds = round(max(0.0, (ended - began).total_seconds()), 3) if ended is not None else None
            times.append(PhaseTime(phase=entry.phase, started_at=began, seconds=seconds))
        return times

    def view(self, filenames: dict[str, str | None] | None = None) -> JobView:
        """The public resource (no tenant, no idempotency key); ``filenames`` maps the input
        digests to the names they were uploaded with."""
        names = filenames or {}
        return JobView(
            id=self.id,
            status=self.status,
            spec=self.spec,
            progress=self.progress(),
            error=self.error,
            artifacts=dict(self.artifacts),
            report=self.report,
            attempts=self.attempts,
            created_at=self.created_at,
            started_at=self.started_at,
            finished_at=self.finished_at,
            inputs={
                name: InputFile(digest=digest, filename=names.get(digest))
                for name, digest in self.input_digests().items()
            },
            phases=self.phase_times(),
            revision=self.revision,
        )


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


def check_submission(
    spec: JobSpec, tenant: str, blobs: BlobStore, settings: Settings, nodes: list[Node] | None = None
) -> None:
    """Refuse a spec whose model, blobs, data path or architecture cannot work, or whose ranks
    the cluster as it is (``nodes``, as last seen; None: asked now) could never place, naming the field.
    A sweep's models are checked as far as the sweep as a whole goes (their blobs exist, their
    architectures are allowed); what is wrong with one model's file fails its cells alone (docs/sweeps.md)."""
    if spec.is_sweep:
        _check_sweep(spec, settings)
    else:
        if spec.data is None:
            raise SpecError("data: give the calibration data (or datasets, for a sweep)", field="data")
        for name in ("pairs", "rank_by"):
            if getattr(spec, name) is not None:
                raise SpecError(f"{name} goes with a sweep (models or datasets)", field=name)
        if spec.cells_at_once != 1:
            raise SpecError("cells_at_once goes with a sweep (models or datasets)", field="cells_at_once")
        check_model_choice(spec.arch, spec.checkpoint, spec.program, spec.model_kwargs)
        check_model_kwargs(spec.model_kwargs)
        if spec.arch is not None:
            check_architecture(spec.arch, settings)
    _check_outputs(spec)
    check_fits_cluster(spec.model_copy(update={"workers": spec.ranks}), settings, nodes)
    named = spec.input_sources()
    for name, source in named.items():
        if isinstance(source, str) and not blobs.exists(tenant, source):
            raise SpecError(f"{name}: no blob {source} for this API key; upload it to /v1/blobs first", field=name)
        if isinstance(source, DataPath):
            resolve_data_path(source.path, settings, field=f"{name}.path")
        if isinstance(source, DataUri):
            check_data_uri(source.uri, settings, field=f"{name}.uri")
    if spec.transform is not None and len(repr(spec.transform)) > 4096:
        raise SpecError("transform is too large", field="transform")
    if spec.is_sweep:
        return  # a model's file is its cells' to fail on
    if spec.program is not None:
        check_program(blobs.path(tenant, spec.program), blobs.filename(tenant, spec.program) or spec.program)
    if spec.arch is not None and isinstance(spec.checkpoint, str):  # the costliest check last
        check_checkpoint_fits(
            spec.arch, spec.model_kwargs, blobs.path(tenant, spec.checkpoint),
            allowed_modules=tuple(settings.model_modules), max_bytes=settings.max_model_bytes,
            name=blobs.filename(tenant, spec.checkpoint) or spec.checkpoint,
        )
        for name, source in named.items():  # the data the model takes, as cheaply (a forward on meta)
            if name in ("data", "eval.data") and isinstance(source, str):
                check_data_fits(
                    spec.arch, spec.model_kwargs, array_sample_shape(blobs.path(tenant, source)),
                    allowed_modules=tuple(settings.model_modules), field=name, name=blobs.filename(tenant, source) or source,
                )


def _check_sweep(spec: JobSpec, settings: Settings) -> None:
    """A sweep's own fields: models in place of the single model, named sets in place of the
    data, each model's choice and architecture, names, pairs and the ranking metric."""
    if spec.models is not None:
        for name in ("checkpoint", "program"):
            if getattr(spec, name) is not None:
                raise SpecError(f"{name} does not go with models: give each model in models", field=name)
    if spec.datasets is not None:
        for name in ("data", "eval"):
            if getattr(spec, name) is not None:
                raise SpecError(f"{name} does not go with datasets: give each set in datasets", field=name)
    elif spec.data is None:
        raise SpecError("data: give the calibration data, or datasets", field="data")
    names: set[str] = set()
    for index, model in enumerate(spec.sweep_models()):
        where = f"models[{index}]" if spec.models is not None else ""
        arch = model.arch or (None if model.program else spec.arch)
        kwargs = model.model_kwargs if model.model_kwargs is not None else ({} if model.program else spec.model_kwargs)
        try:
            check_model_choice(arch, model.checkpoint, model.program, kwargs)
            check_model_kwargs(kwargs)
            if arch is not None:
                try:
                    check_architecture(arch, settings)
                except InputError as exc:  # its own problem type, the field named in full
                    if where and not isinstance(exc, SpecError):
                        exc.field = f"{where}.arch"  # type: ignore[attr-defined]
                    raise
            if model.name is not None:
                check_name(model.name, "model", "name")
        except SpecError as exc:
            if not where:
                raise
            field_name = f"{where}.{exc.field}" if exc.field else where
            raise SpecError(f"{where}: {exc.message}", field=field_name) from None
        if model.name is not None:
            if model.name in names:
                raise SpecError(f"{where}.name: the name {model.name!r} is given twice", field=f"{where}.name")
            names.add(model.name)
    sets = spec.sweep_sets()
    for name, calibration in sets.items():
        check_name(name, "set", f"datasets.{name}")
        if spec.int8 is not None and spec.int8.max_top1_drop is not None and calibration.eval is None:
            raise SpecError(f"datasets.{name}.eval: int8.max_top1_drop measures top-1 on every set's eval data",
                            field=f"datasets.{name}.eval")
    count = len(spec.sweep_models())
    for index, (model_index, set_name) in enumerate(spec.pairs or []):
        if not 0 <= model_index < count:
            raise SpecError(f"pairs[{index}]: no model {model_index} (models 0-{count - 1})", field=f"pairs[{index}]")
        if set_name not in sets:
            raise SpecError(f"pairs[{index}]: no set named {set_name!r} (sets: {', '.join(sets)})",
                            field=f"pairs[{index}]")
    if spec.rank_by is not None:
        check_metric(spec.rank_by)


def _check_outputs(spec: JobSpec) -> None:
    """The model artifact asked for is the one the model can give: a checkpoint for an
    architecture, a program for a program."""
    wrong = "checkpoint" if spec.program is not None else "program"
    if spec.outputs is not None and wrong in spec.outputs and not spec.is_sweep:  # a sweep's cells: each its own
        have = "program" if spec.program is not None else "checkpoint"
        raise SpecError(f"outputs: a job on a {have} gives a {have}, not a {wrong}", field="outputs")
    if spec.int8 is not None and "onnx_int8" not in (spec.outputs or []):
        raise SpecError('int8: the INT8 options go with "onnx_int8" in outputs', field="int8")
    if spec.int8 is not None and spec.int8.max_top1_drop is not None and spec.eval is None and not spec.is_sweep:
        raise SpecError("int8.max_top1_drop: give eval (labelled data) to measure top-1 on", field="int8.max_top1_drop")


def check_architecture(arch: str, settings: Settings) -> None:
    """Refuse an architecture that cannot be built (outside the allowlist, an unknown name,
    a missing callable) before a job exists; the error suggests close names."""
    check_reference(arch, settings.model_modules)


def resolve_data_path(path: str, settings: Settings, field: str = "data.path") -> Path:
    """The real location of server-side data, which must lie under a configured data root.

    Symlinks are resolved first, so a link cannot lead out of a root. ``field`` names the
    spec field in errors.
    """
    if not settings.data_roots:
        raise SpecError(
            f"{field}: this server reads no server-side paths (the operator sets BNRECAL_DATA_ROOTS); "
            "upload the data to /v1/blobs instead",
            field=field,
        )
    requested = Path(path)
    if not requested.is_absolute():
        raise SpecError(f"{field} must be absolute, got {path!r}", field=field)
    _refuse_manifest(path, field)
    if has_brace_pattern(path):  # shards: every one it names lies under the root its folder lies in
        try:
            names = expand_braces(path)
        except DatasetError as exc:
            raise SpecError(f"{field}: {exc.message}", field=field) from exc
        folder = _under_root(str(requested.parent), settings, field, path)
        for name in names:
            _under_root(name, settings, field, path)
        return folder / requested.name
    return _under_root(path, settings, field, path)


def _under_root(path: str, settings: Settings, field: str, shown: str) -> Path:
    """The real location of ``path`` (symlinks resolved), which must exist under a data root."""
    resolved = Path(os.path.realpath(path))
    for root in settings.data_roots:
        real_root = Path(os.path.realpath(root))
        if resolved == real_root or resolved.is_relative_to(real_root):
            if not resolved.exists():
                missing = shown if path == shown else f"{shown}: {Path(path).name}"
                raise SpecError(f"{field} {missing!r} does not exist", field=field)
            return resolved
    raise SpecError(f"{field} {shown!r} is outside the server's data roots (BNRECAL_DATA_ROOTS)", field=field)


def _refuse_manifest(location: str, field: str) -> None:
    """A manifest names shards anywhere: a server reads only what its roots and prefixes allow,
    so it takes the shards' folder, prefix or brace pattern instead (docs/data.md)."""
    if is_manifest_name(location):
        raise SpecError(
            f"{field}: a server does not read manifests (their lines could name any file or bucket); give the "
            "shards' folder or prefix, or a brace pattern such as train-{000000..000146}.tar",
            field=field,
        )


def check_data_uri(uri: str, settings: Settings, field: str = "data.uri") -> str:
    """The normalised URI of object-storage data, which must lie under a prefix of
    ``BNRECAL_DATA_URIS`` (an open server must not read the operator's whole storage)."""
    normalised = parse_data_uri(uri, field)
    _refuse_manifest(normalised, field)
    if has_brace_pattern(normalised):
        try:
            expand_braces(normalised)  # braces only in the last component: the allowlist check below holds for all
        except DatasetError as exc:
            raise SpecError(f"{field}: {exc.message}", field=field) from exc
    if not settings.data_uris:
        raise SpecError(
            f"{field}: this server reads no object storage (the operator sets BNRECAL_DATA_URIS); "
            "upload the data to /v1/blobs instead",
            field=field,
        )
    if not uri_allowed(normalised, settings.data_uris):
        raise SpecError(f"{field} {uri!r} is outside the server's allowed prefixes (BNRECAL_DATA_URIS)", field=field)
    return normalised
