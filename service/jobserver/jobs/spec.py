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
from bnrecal.service.jobserver.jobs.views import Artifact, InputFile, JobStatus, JobView, PhaseTime, Progress
from bnrecal.service.jobserver.problems import Problem
from bnrecal.service.jobserver.storage.blobs import DIGEST_PATTERN, BlobStore
from bnrecal.service.jobserver.cluster.capacity import Node, check_fits_cluster

ARTIFACT_NAMES = ("checkpoint", "program", "onnx", "onnx_int8", "report", "report.html")


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


class JobSpec(RunOptions):
    """What to recalibrate (the run options), on what checkpoint (or program) and data, and
    which artifacts to produce."""

    checkpoint: Digest | None = Field(default=None, description="Digest of an uploaded checkpoint blob (with arch).")
    program: Digest | None = Field(
        default=None,
        description="Digest of an uploaded torch.export program (.pt2), instead of arch and checkpoint: "
        "it carries its architecture.",
    )
    data: DataSource = Field(
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

    @field_validator("outputs")
    @classmethod
    def _unique_outputs(cls, value: list[str] | None) -> list[str] | None:
        return list(dict.fromkeys(value)) if value is not None else None

    def with_outputs(self) -> JobSpec:
        """This spec with its outputs spelled out: the model in the form it came in (the
        checkpoint, or the program) unless the submitter chose."""
        if self.outputs is not None:
            return self
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
    artifacts: dict[str, dict[str, Any]]
    report: dict[str, Any] | None
    revision: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    phases: list[dict[str, Any]] = field(default_factory=list)

    def progress(self) -> Progress:
        """The job's progress as the API shows it."""
        return Progress(samples_done=self.samples_done, samples_total=self.samples_total, phase=self.phase)

    def input_digests(self) -> dict[str, str]:
        """The uploaded blobs the spec names, by field (``checkpoint``, ``program``, ``data``, ``eval.data``)."""
        named = {name: self.spec.get(name) for name in ("checkpoint", "program", "data")}
        evaluation = self.spec.get("eval")
        named["eval.data"] = evaluation.get("data") if isinstance(evaluation, dict) else None
        return {name: value for name, value in named.items() if isinstance(value, str)}

    def phase_times(self) -> list[PhaseTime]:
        """Each phase of the last run with its duration: until the next phase began, the last
        one until the job finished (null while the job is still in it)."""
        times: list[PhaseTime] = []
        for index, entry in enumerate(self.phases):
            began = datetime.fromisoformat(entry["at"])
            ended = datetime.fromisoformat(self.phases[index + 1]["at"]) if index + 1 < len(self.phases) else None
            if ended is None and self.status.is_terminal:
                ended = self.finished_at
            seconds = round(max(0.0, (ended - began).total_seconds()), 3) if ended is not None else None
            times.append(PhaseTime(phase=entry["phase"], started_at=began, seconds=seconds))
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
            artifacts={name: Artifact(**info) for name, info in self.artifacts.items()},
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


def check_submission(
    spec: JobSpec, tenant: str, blobs: BlobStore, settings: Settings, nodes: list[Node] | None = None
) -> None:
    """Refuse a spec whose model, blobs, data path or architecture cannot work, or whose ranks
    the cluster as it is (``nodes``, as last seen; None: asked now) could never place, naming the field."""
    check_model_choice(spec.arch, spec.checkpoint, spec.program, spec.model_kwargs)
    check_model_kwargs(spec.model_kwargs)
    _check_outputs(spec)
    check_fits_cluster(spec, settings, nodes)
    if spec.arch is not None:
        check_architecture(spec.arch, settings)
    named = [(name, digest) for name, digest in (("checkpoint", spec.checkpoint), ("program", spec.program)) if digest]
    named.append(("data", spec.data))
    if spec.eval is not None:
        named.append(("eval.data", spec.eval.data))
    for name, source in named:
        if isinstance(source, str) and not blobs.exists(tenant, source):
            raise SpecError(f"{name}: no blob {source} for this API key; upload it to /v1/blobs first", field=name)
        if isinstance(source, DataPath):
            resolve_data_path(source.path, settings, field=f"{name}.path")
        if isinstance(source, DataUri):
            check_data_uri(source.uri, settings, field=f"{name}.uri")
    if spec.transform is not None and len(repr(spec.transform)) > 4096:
        raise SpecError("transform is too large", field="transform")
    if spec.program is not None:
        check_program(blobs.path(tenant, spec.program), blobs.filename(tenant, spec.program) or spec.program)
    if spec.arch is not None and isinstance(spec.checkpoint, str):  # the costliest check last
        check_checkpoint_fits(
            spec.arch, spec.model_kwargs, blobs.path(tenant, spec.checkpoint),
            allowed_modules=tuple(settings.model_modules), max_bytes=settings.max_model_bytes,
            name=blobs.filename(tenant, spec.checkpoint) or spec.checkpoint,
        )
        for name, source in named:  # the data the model takes, as cheaply (a forward on meta)
            if name in ("data", "eval.data") and isinstance(source, str):
                check_data_fits(
                    spec.arch, spec.model_kwargs, array_sample_shape(blobs.path(tenant, source)),
                    allowed_modules=tuple(settings.model_modules), field=name, name=blobs.filename(tenant, source) or source,
                )


def _check_outputs(spec: JobSpec) -> None:
    """The model artifact asked for is the one the model can give: a checkpoint for an
    architecture, a program for a program."""
    wrong = "checkpoint" if spec.program is not None else "program"
    if spec.outputs is not None and wrong in spec.outputs:
        have = "program" if spec.program is not None else "checkpoint"
        raise SpecError(f"outputs: a job on a {have} gives a {have}, not a {wrong}", field="outputs")
    if spec.int8 is not None and "onnx_int8" not in (spec.outputs or []):
        raise SpecError('int8: the INT8 options go with "onnx_int8" in outputs', field="int8")
    if spec.int8 is not None and spec.int8.max_top1_drop is not None and spec.eval is None:
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
