"""A job's inputs made into the engine's request: each uploaded blob hashed against its digest
first (docs/storage.md, "Stored bytes are verified"), server paths and URIs checked again
against the settings, and the names messages call them by."""

from __future__ import annotations

from pathlib import Path

from bnrecal.service.run.recalibrate import RecalibrationRequest

from bnrecal.service.settings import Settings
from bnrecal.service.jobserver.storage.blobs import BlobStore
from bnrecal.service.jobserver.jobs.spec import DataPath, DataUri, JobRecord, JobSpec, check_data_uri, resolve_data_path


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


def checked_inputs(job: JobRecord, spec: JobSpec, blobs: BlobStore) -> dict[str, Path]:
    """The job's input blobs by spec field, each hashed against its digest."""
    named = {"checkpoint": spec.checkpoint, "program": spec.program, "data": spec.data}
    if spec.eval is not None:
        named["eval.data"] = spec.eval.data
    return {
        field: blobs.check(job.tenant, digest, field=field)
        for field, digest in named.items()
        if isinstance(digest, str)
    }


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
