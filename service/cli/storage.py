"""The storage commands: ``gc`` (collect expired storage in a data dir) and ``delete JOB`` (on a server)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bnrecal.errors import InputError

from . import options as opt
from .console import connect, print_line


def collect_garbage(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be deleted.")] = False,
    data_dir: Annotated[
        Path | None, typer.Option(help="The service's data directory (default: BNRECAL_DATA_DIR, else .bnrecal).")
    ] = None,
) -> None:
    """Delete finished jobs past retention, blobs and unpacked archives nothing needs any more.

    Works on the data directory itself, safely while a server uses it: both decide from the
    job ledger, and nothing a queued, running or retained job needs is deleted. Retention
    comes from BNRECAL_JOB_RETENTION_S, BNRECAL_BLOB_RETENTION_S and BNRECAL_UNPACK_RETENTION_S.
    """
    from ..jobserver.storage.blobs import open_blob_store
    from ..jobserver.ledger import Ledger, sqlite_url
    from ..jobserver.storage.collection import StorageCollector
    from ..settings import Settings

    settings = Settings()
    directory = Path(data_dir if data_dir is not None else settings.data_dir).absolute()
    if not (directory / "blobs").is_dir():
        raise InputError(f"{directory} is not a bnrecal data directory (no blobs/ in it); pass --data-dir "
                         "or set BNRECAL_DATA_DIR")
    settings = settings.model_copy(update={"data_dir": directory})
    ledger = Ledger(settings.database_url or sqlite_url(directory))
    try:
        blobs = open_blob_store(settings.blob_store, directory / "blobs", settings.s3_endpoint_url)
        report = StorageCollector(settings, ledger, blobs).collect(dry_run=dry_run)
    finally:
        ledger.close()
    verb = "would delete" if dry_run else "deleted"
    for removal in report.removals:
        owner = f" of {removal.tenant}" if removal.tenant else ""
        typer.echo(f"{verb} {removal.kind} {removal.name}{owner} ({removal.size} bytes): {removal.reason}")
    typer.echo(report.summary())


def delete_job(job_id: opt.JobIdArg, server: opt.ServerOpt, api_key: opt.ApiKeyOpt = None) -> None:
    """Delete a finished job on a server, with its artifacts (cancel a queued or running one first)."""
    with connect(server, api_key) as client:
        client.delete_job(job_id)
    print_line(f"job {job_id} deleted on {server}")
