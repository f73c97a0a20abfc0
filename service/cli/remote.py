"""The commands that talk HTTP: ``serve`` (run the service) and ``submit`` (a job on a
server: upload, submit, follow, download)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from bnrecal.errors import BnrecalError, CancelledError, ExportError, SpecError

from bnrecal.service.run.progress import progress_bar

from . import options as opt
from .console import connect, fail, print_line, summary_lines
from .jobs import cancel_and_wait

if TYPE_CHECKING:
    from ..client import BnrecalClient

APP_FACTORY = "bnrecal.api.app:create_app"
"""The HTTP app, started by name: the HTTP layer imports the service core, not the reverse."""
HTTP_PROTOCOL = "bnrecal.api.http11:ProblemH11Protocol"
"""uvicorn's h11 protocol answering unparseable requests (headers too large: 431) with
problem+json the client receives, by name for the same reason."""


def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    data_dir: Annotated[Path | None, typer.Option(help="Ledger, blobs and artifacts (default BNRECAL_DATA_DIR).")] = None,
    ray_address: Annotated[str | None, typer.Option(help="Existing Ray cluster (default: RAY_ADDRESS/embedded).")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Run the HTTP service: SQLite ledger and blobs under --data-dir, jobs on Ray."""
    import uvicorn

    from ..settings import Settings, get_settings

    if not 0 < port < 65536:
        raise SpecError(f"--port must be between 1 and 65535, got {port}", field="--port")
    # The flags reach the app's settings through the environment it reads them from.
    if data_dir is not None:
        os.environ["BNRECAL_DATA_DIR"] = str(data_dir)
    if ray_address:
        os.environ["BNRECAL_RAY_ADDRESS"] = ray_address
    get_settings.cache_clear()
    data = Path(Settings().data_dir).absolute()
    print_line(f"bnrecal serving on http://{host}:{port} (data in {data})")
    uvicorn.run(
        APP_FACTORY, factory=True, http=HTTP_PROTOCOL, host=host, port=port, log_level=log_level,
        timeout_graceful_shutdown=10,
    )
    _leave_ray()
    _end_process()


def _end_process() -> None:
    """End the stopped server's process at once. Everything it keeps is closed and on disk
    by now (the ledger, blobs, Ray's processes); what is left is the interpreter's own
    teardown, a full garbage collection over all that torch, onnx and Ray loaded, which
    took 3 s here and would keep a server on Ctrl-C or ``timeout`` alive past the seconds
    a stop is given (docs/api.md, "Restarts")."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave_ray() -> None:
    """Leave a joined Ray cluster before the process ends, within moments: Ray's own exit
    handler would wait on a cluster that does not answer until its reconnect timeout (a
    minute), so the server ends without it then (docs/api.md, "Restarts")."""
    import os
    import sys

    import ray

    from bnrecal.service.jobserver.server import RAY_SHUTDOWN_S, shutdown_within

    if ray.is_initialized() and not shutdown_within(2 * RAY_SHUTDOWN_S):
        print("error: the Ray cluster did not let go within "
              f"{2 * RAY_SHUTDOWN_S:g} s: exiting without it", file=sys.stderr, flush=True)
        os._exit(1)


@opt.run_command(server="out", api_key="program", ray_address="transform")
def submit(
    flags: opt.RunFlags,
    server: opt.ServerOpt,
    api_key: opt.ApiKeyOpt = None,
    ray_address: Annotated[str | None, typer.Option(hidden=True, help="Not for submit: the server's setting.")] = None,
) -> None:
    """Run a recalibration on a bnrecal server: upload, submit, follow, download."""
    if ray_address:
        raise SpecError(
            "--ray-address does not apply to submit: the server picks the cluster (bnrecal serve --ray-address)",
            field="--ray-address",
        )
    flags.check_model()
    data_source, eval_source = opt.data_source(flags.data, "--data"), opt.data_source(flags.eval_data, "--eval-data")
    opt.check_paths(
        {"--checkpoint": flags.checkpoint, "--program": flags.program, "--data": data_source, "--eval-data": eval_source},
        {"--out": flags.out, "--onnx": flags.onnx, "--onnx-int8": flags.onnx_int8, "--report": flags.report,
         "--report-html": flags.report_html},
    )
    options = flags.run_options()
    int8_options = flags.int8_options()
    model_output = "program" if flags.program is not None else "checkpoint"
    spec: dict[str, Any] = {
        **options.run_options(),
        "outputs": [model_output] + (["onnx"] if flags.onnx is not None else []),
        "onnx": {"opset": flags.onnx_opset, "dtype": flags.onnx_dtype.value},
    }
    if int8_options is not None:
        spec["outputs"].append("onnx_int8")
        spec["int8"] = int8_options.model_dump(exclude_defaults=True)
    models = (("checkpoint", flags.checkpoint), ("program", flags.program))
    local_files = {name: path for name, path in models if path is not None}
    local_files |= {name: path for name, path in (("data", data_source), ("eval.data", eval_source))
                    if isinstance(path, Path)}
    with connect(server, api_key) as client:
        digests: dict[str, Any] = {name: _digest(path) for name, path in local_files.items()}
        for name, source in (("data", data_source), ("eval.data", eval_source)):
            if isinstance(source, str):  # an s3:// URI: the server reads it
                digests[name] = {"uri": source}
        _put_inputs(spec, digests, flags.eval_max_samples)
        missing = [] if _dry_run(client, spec) else [name for name in local_files if not client.has_blob(digests[name])]
        for name in missing:
            digests[name] = _upload(client, local_files[name])
        _put_inputs(spec, digests, flags.eval_max_samples)
        job = client.submit(spec, idempotency_key=uuid.uuid4().hex)
        typer.echo(job["id"])  # the one line on stdout: JOB=$(bnrecal submit ...)
        print_line(f"job {job['id']} queued on {client.server}")
        with progress_bar("queued") as update:
            try:
                job = client.wait(job["id"], on_progress=update)
            except KeyboardInterrupt:
                _cancel_on_interrupt(client, job["id"])
            _raise_unless_succeeded(job)
            int8_section = (job.get("report") or {}).get("int8") or {}
            int8_failed = int8_section.get("written") is False  # its guard failed: no file (docs/int8.md)
            downloads = [(model_output, flags.out), ("onnx", flags.onnx),
                         ("onnx_int8", None if int8_failed else flags.onnx_int8),
                         ("report", flags.report), ("report.html", flags.report_html)]
            wanted = [(name, path) for name, path in downloads if path is not None]
            for done, (name, path) in enumerate(wanted):
                update(done, len(wanted), "downloading")
                client.download(job["id"], name, path)
            update(len(wanted), len(wanted), "downloading")
    written_int8 = None if int8_failed else flags.onnx_int8
    also_wrote = (flags.onnx, written_int8, flags.report, flags.report_html)
    for line in summary_lines(job["report"], flags.out, job["id"], also_wrote=also_wrote):
        print_line(line)
    if int8_failed:  # exit 1, as a local calibrate: the INT8 file asked for was not written
        raise ExportError(str(int8_section.get("failure", "the INT8 output failed")))


BLOB_FIELDS = ("checkpoint", "program", "data", "eval.data")
"""The spec fields that name an uploaded file by its digest."""


def _digest(path: Path) -> str:
    """The digest the server names a file's (or a folder's tar's) blob by, computed here."""
    from ..client import file_digest, prepared_upload

    with prepared_upload(path) as prepared:
        return file_digest(prepared)


def _put_inputs(spec: dict[str, Any], digests: dict[str, Any], eval_max_samples: int | None) -> None:
    """Name the inputs in the spec: digests of files, or URIs the server reads."""
    for name in ("checkpoint", "program", "data"):
        if name in digests:
            spec[name] = digests[name]
    if "eval.data" in digests:
        spec["eval"] = {"data": digests["eval.data"], "max_samples": eval_max_samples}


def _dry_run(client: BnrecalClient, spec: dict[str, Any]) -> bool:
    """Check the spec on the server before any byte of a file is sent (``dry_run=true``),
    naming the files by the digests computed here: True when it passed whole (the server has
    every file). The only refusal an upload fixes is a file the server does not have yet
    (False: ``HEAD`` then tells which); any other is the command's error (exit 2 for bad
    input, with the server's hint)."""
    try:
        client.check(spec)
    except SpecError as exc:
        if exc.field not in BLOB_FIELDS:
            raise
        return False
    return True


def _upload(client: BnrecalClient, path: Path) -> str:
    """Upload one file the server lacks, with a progress bar in bytes on a terminal; its digest."""
    label = f"uploading {path.name}"
    with progress_bar(label) as update:
        blob = client.upload(path, on_bytes=lambda sent, total: update(sent, total, label))
    return str(blob["digest"])


def _cancel_on_interrupt(client: BnrecalClient, job_id: str) -> NoReturn:
    """Ctrl-C while following a job: cancel it on the server, say so, and exit 130."""
    try:
        status = cancel_and_wait(client, job_id)
        outcome = "cancelled" if status == "cancelled" else f"cancel requested ({status})"
        message = f"interrupted: job {job_id} {outcome} on {client.server}"
    except (BnrecalError, KeyboardInterrupt) as exc:
        detail = exc.message if isinstance(exc, BnrecalError) else "interrupted again"
        message = f"interrupted: job {job_id} may still run on {client.server} ({detail}); bnrecal cancel {job_id}"
    fail(message, 130)


def _raise_unless_succeeded(job: dict[str, Any]) -> None:
    """Turn a failed or cancelled job into the error it ended with."""
    if job["status"] == "succeeded":
        return
    if job["status"] == "cancelled":
        raise CancelledError(f"job {job['id']} was cancelled")
    problem = job.get("error") or {"status": 500, "detail": f"job {job['id']} {job['status']}"}
    from ..client import error_from_problem

    raise error_from_problem(problem)
