"""A job's inputs made into the engine's request: each uploaded blob hashed against its digest
first (docs/storage.md, "Stored bytes are verified"), server paths and URIs checked again
against the settings, and the names messages call them by."""

from __future__ import annotations

import re
from pathlib import Path

from bnrecal.service.run.recalibrate import RecalibrationRequest
from bnrecal.service.sweep.cells import CalibrationSet, SweepFiles, SweepModel, unique_names

from bnrecal.service.settings import Settings
from bnrecal.service.jobserver.storage.blobs import BlobStore
from bnrecal.service.jobserver.records.record import JobRecord
from bnrecal.service.jobserver.records.spec import DataPath, DataUri, JobSpec
from bnrecal.service.jobserver.jobs.submission import check_data_uri, resolve_data_path


def job_request(job: JobRecord, spec: JobSpec, blobs: BlobStore, settings: Settings) -> RecalibrationRequest:
    """The engine's request for a job (archives unpack under the data dir, one folder per digest).

    Blobs are stored under their digest, so the request carries the names they were
    uploaded with for its messages (the digest, for a blob uploaded without one). Each input
    blob is hashed before anything reads it: a damaged one fails the job at once
    (``CorruptBlobError`` naming the blob and the field) and is quarantined, so the next
    upload stores it again.
    """
    evaluation = spec.eval
    checked = checked_inputs(job, spec, blobs)
    return RecalibrationRequest(
        **spec.run_options(),
        checkpoint=checked.get("checkpoint"),
        checkpoint_name=blob_name(job, spec.checkpoint, blobs) if spec.checkpoint else None,
        program=checked.get("program"),
        program_name=blob_name(job, spec.program, blobs) if spec.program else None,
        data=data_path(job, spec.data, blobs, settings, checked.get("data")),
        data_name=blob_name(job, spec.data, blobs),
        eval_data=data_path(job, evaluation.data, blobs, settings, checked.get("eval.data")) if evaluation else None,
        eval_data_name=blob_name(job, evaluation.data, blobs) if evaluation is not None else None,
        eval_max_samples=evaluation.max_samples if evaluation is not None else None,
    )


def sweep_files(job: JobRecord, spec: JobSpec, blobs: BlobStore, settings: Settings) -> SweepFiles:
    """A sweep job's models and sets as the sweep runner takes them: every input blob hashed
    first, as a single job's; each model named by its ``name``, else its upload's file stem,
    else ``model-<index>`` (colliding stems get ``-2``, ``-3``, ...)."""
    checked = checked_inputs(job, spec, blobs)
    specs = spec.sweep_models()
    stems = []
    for index, model in enumerate(specs):
        digest = model.program or model.checkpoint
        uploaded = blobs.filename(job.tenant, digest) if digest else None
        stems.append(model.name or _stem(uploaded) or f"model-{index}")
    names = unique_names(stems)
    prefix = "models[{}]." if spec.models is not None else ""
    models = []
    for index, (model, name) in enumerate(zip(specs, names, strict=True)):
        program = model.program is not None
        digest = model.program or model.checkpoint
        models.append(SweepModel(
            name=name,
            arch=None if program else model.arch or spec.arch,
            model_kwargs={} if program else (model.model_kwargs if model.model_kwargs is not None else spec.model_kwargs),
            checkpoint=None if program else checked[prefix.format(index) + "checkpoint"],
            program=checked[prefix.format(index) + "program"] if program else None,
            source_name=blobs.filename(job.tenant, digest) or digest if digest else None,
        ))
    sets = []
    for name, calibration in spec.sweep_sets().items():
        where = f"datasets.{name}." if spec.datasets is not None else ""
        evaluation = calibration.eval
        sets.append(CalibrationSet(
            name=name,
            data=data_path(job, calibration.data, blobs, settings, checked.get(where + "data")),
            data_name=blob_name(job, calibration.data, blobs),
            eval_data=data_path(job, evaluation.data, blobs, settings, checked.get(where + "eval.data"))
            if evaluation is not None else None,
            eval_data_name=blob_name(job, evaluation.data, blobs) if evaluation is not None else None,
            eval_max_samples=evaluation.max_samples if evaluation is not None else None,
        ))
    pairs = {(names[index], set_name) for index, set_name in spec.pairs} if spec.pairs is not None else None
    return SweepFiles(models, sets, pairs)


def _stem(filename: str | None) -> str | None:
    """A folder-safe name from an upload's file name (``resnet18-p50.pt`` -> ``resnet18-p50``), or None."""
    if not filename:
        return None
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(filename).stem).strip("-._")[:128]
    return stem or None


def checked_inputs(job: JobRecord, spec: JobSpec, blobs: BlobStore) -> dict[str, Path]:
    """The job's input blobs by spec field, each hashed against its digest once (a sweep may
    name one blob in many fields)."""
    checked: dict[str, Path] = {}
    by_field: dict[str, Path] = {}
    for field, digest in spec.input_sources().items():
        if isinstance(digest, str):
            if digest not in checked:
                checked[digest] = blobs.check(job.tenant, digest, field=field)
            by_field[field] = checked[digest]
    return by_field


def blob_name(job: JobRecord, source: str | DataPath | DataUri, blobs: BlobStore) -> str | None:
    """What messages call a spec's blob: its upload's file name, else its digest (None for a path or URI)."""
    if isinstance(source, (DataPath, DataUri)):
        return None
    return blobs.filename(job.tenant, source) or source


def data_path(
    job: JobRecord, data: str | DataPath | DataUri, blobs: BlobStore, settings: Settings, checked: Path | None = None
) -> Path | str:
    """Where a spec's data lies: an uploaded blob of the tenant (already checked), a path under
    a data root, or a URI under an allowed prefix (checked again: the settings may have changed)."""
    if isinstance(data, DataUri):
        return check_data_uri(data.uri, settings)
    if isinstance(data, DataPath):
        return resolve_data_path(data.path, settings)
    return checked if checked is not None else blobs.path(job.tenant, data)
