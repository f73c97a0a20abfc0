"""The commands for jobs submitted earlier: ``jobs`` (list), ``status ID`` and ``cancel ID``."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer

from ..client import TERMINAL, BnrecalClient
from . import options as opt
from .console import evaluation_line, print_line


def list_jobs(
    server: opt.ServerOpt,
    api_key: opt.ApiKeyOpt = None,
    status: Annotated[
        str | None, typer.Option(help="Only jobs in this status (queued, running, succeeded, failed, cancelled).")
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.", min=1, max=500)] = 20,
) -> None:
    """List this API key's jobs on a server, newest first: id, status, phase and progress, model."""
    with BnrecalClient(server, api_key) as client:
        jobs = client.jobs(status=status, limit=limit)
    if not jobs:
        print_line(f"no jobs on {server}" + (f" with status {status}" if status else ""))
        return
    for job in jobs:
        typer.echo(f"{job['id']}  {job['status']:<9}  {_progress_text(job):<28}  "
                   f"{job['created_at'][:19].replace('T', ' ')}  {_model(job['spec'])}")


def job_status(
    job_id: opt.JobIdArg,
    server: opt.ServerOpt,
    api_key: opt.ApiKeyOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the job as the API returns it.")] = False,
) -> None:
    """Show one job: status, phase and progress, the error it failed with, its outcome and files."""
    with BnrecalClient(server, api_key) as client:
        job = client.job(job_id)
    if as_json:
        typer.echo(json.dumps(job, indent=2))
        return
    for line in status_lines(job):
        typer.echo(line)


def cancel(job_id: opt.JobIdArg, server: opt.ServerOpt, api_key: opt.ApiKeyOpt = None) -> None:
    """Cancel a queued or running job; a job that already ended is left as it is (exit 1)."""
    with BnrecalClient(server, api_key) as client:
        job = client.job(job_id)
        if job["status"] in TERMINAL:
            print_line(f"job {job_id} already {job['status']}; nothing to cancel")
            raise typer.Exit(1)
        status = cancel_and_wait(client, job_id)
    print_line(f"job {job_id} {'cancelled' if status == 'cancelled' else f'cancel requested ({status})'} on {server}")


def cancel_and_wait(client: BnrecalClient, job_id: str, timeout: float = 10.0) -> str:
    """Cancel a job and wait (a few seconds at most) until it has ended; its last status.

    A running job ends once its ranks are stopped, which is why "cancelled" can take a moment.
    """
    status = client.cancel(job_id)["status"]
    deadline = time.monotonic() + timeout
    while status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.2)
        status = client.job(job_id)["status"]
    return status


def status_lines(job: dict[str, Any]) -> list[str]:
    """The lines ``bnrecal status`` prints for a job."""
    spec = job["spec"]
    lines = [
        f"job {job['id']}: {job['status']}",
        f"model {_model(spec)}, {spec.get('workers')} worker(s), {spec.get('mode')} mode, "
        f"batch {spec.get('batch_size')}",
        f"created {job['created_at']}" + (f", finished {job['finished_at']}" if job.get("finished_at") else ""),
    ]
    if job["status"] not in TERMINAL:
        lines.append(f"progress: {_progress_text(job)}")
    error = job.get("error")
    if error:
        field = f" (field {error['field']})" if error.get("field") else ""
        lines.append(f"error: {error.get('title', 'error')}: {error.get('detail', '')}{field}")
    report = job.get("report")
    if report:
        lines.append(f"recalibrated {len(report['layers'])} BN layers on {report['samples']} samples "
                     f"in {report['seconds']:.2f} s")
        if report.get("evaluation"):
            lines.append(evaluation_line(report["evaluation"]))
    if job.get("artifacts"):
        lines.append("artifacts: " + ", ".join(sorted(job["artifacts"])))
    return lines


def _progress_text(job: dict[str, Any]) -> str:
    """``calibrating 64/1437`` while running; the phase alone where no count applies."""
    if job["status"] in TERMINAL:
        return "-"
    progress = job.get("progress") or {}
    phase = progress.get("phase") or job["status"]
    done, total = progress.get("samples_done") or 0, progress.get("samples_total")
    return f"{phase} {done}/{total}" if total else phase


def _model(spec: dict[str, Any]) -> str:
    """What a job recalibrates, as its spec names it: the architecture, or its program."""
    return spec.get("arch") or ("program" if spec.get("program") else "")
