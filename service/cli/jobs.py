"""The commands for jobs submitted earlier: ``jobs`` (list), ``status ID`` and ``cancel ID``."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated

import typer

from . import options as opt
from .console import connect, print_line
from .job_text import job_table, status_lines

if TYPE_CHECKING:
    from ..client import BnrecalClient


def list_jobs(
    server: opt.ServerOpt,
    api_key: opt.ApiKeyOpt = None,
    status: Annotated[
        str | None, typer.Option(help="Only jobs in this status (queued, running, succeeded, failed, cancelled).")
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.", min=1, max=500)] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print the jobs as the API returns them (a JSON list).")] = False,
) -> None:
    """List this API key's jobs on a server, newest first: a table of id, status, phase or
    result (the failure's title on a failed job), creation time with zone, model and data."""
    with connect(server, api_key) as client:
        jobs = client.jobs(status=status, limit=limit)
    if as_json:
        typer.echo(json.dumps([job.model_dump(mode="json") for job in jobs], indent=2))
        return
    if not jobs:
        print_line(f"no jobs on {server}" + (f" with status {status}" if status else ""))
        return
    for line in job_table(jobs):
        typer.echo(line)


def job_status(
    job_id: opt.JobIdArg,
    server: opt.ServerOpt,
    api_key: opt.ApiKeyOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the job as the API returns it.")] = False,
) -> None:
    """Show one job: status, phase and progress, the error it failed with, its outcome and files."""
    with connect(server, api_key) as client:
        job = client.job(job_id)
    if as_json:
        typer.echo(job.model_dump_json(indent=2))
        return
    for line in status_lines(job):
        typer.echo(line)


def cancel(job_id: opt.JobIdArg, server: opt.ServerOpt, api_key: opt.ApiKeyOpt = None) -> None:
    """Cancel a queued or running job; a job that already ended is left as it is (exit 1)."""
    with connect(server, api_key) as client:
        job = client.job(job_id)
        if job.status.is_terminal:
            print_line(f"job {job_id} already {job.status.value}; nothing to cancel")
            raise typer.Exit(1)
        status = cancel_and_wait(client, job_id)
    print_line(f"job {job_id} {'cancelled' if status == 'cancelled' else f'cancel requested ({status})'} on {server}")


def cancel_and_wait(client: BnrecalClient, job_id: str, timeout: float = 10.0) -> str:
    """Cancel a job and wait (a few seconds at most) until it has ended; its last status.

    A running job ends once its ranks are stopped, which is why "cancelled" can take a moment.
    """
    status = client.cancel(job_id).status
    deadline = time.monotonic() + timeout
    while not status.is_terminal and time.monotonic() < deadline:
        time.sleep(0.2)
        status = client.job(job_id).status
    return status.value
