"""The commands that talk HTTP: ``serve`` (run the service) and ``submit`` (a job on a
server: upload, submit, follow, download)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from bnrecal.errors import BnrecalError, ExportError, SpecError

from bnrecal.service.run.progress import progress_bar
from bnrecal.service.tracking import ending

from . import options as opt
from .console import connect, fail, print_line, summary_lines
from .jobs import cancel_and_wait

if TYPE_CHECKING:
    from ..client import BnrecalClient
    from ..jobserver.records.views import JobView

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
    server = _server_class()(uvicorn.Config(
        APP_FACTORY, factory=True, http=HTTP_PROTOCOL, host=host, port=port, log_level=log_level,
        timeout_graceful_shutdown=10,
    ))
    url = f"http://{host}:{port}"
    print_line(f"bnrecal starting on {url} (data in {data}): opening the ledger and joining Ray")
    threading.Thread(target=_say_when_serving, args=(server, f"bnrecal serving on {url}"), daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises Ctrl-C's SIGINT again once it has stopped
        pass
    _leave_ray()
    _end_process(128 + signal.SIGINT if server.interrupted else 0)


def _server_class() -> Any:
    """uvicorn's server, noting whether Ctrl-C (SIGINT) stopped it: uvicorn raises the signal
    again once it has stopped, which does nothing where SIGINT was ignored when the process
    started (a shell's background job), so the exit code cannot come from that alone."""
    import uvicorn

    class Server(uvicorn.Server):
        interrupted = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.interrupted = self.interrupted or sig == signal.SIGINT
            super().handle_exit(sig, frame)

    return Server


def _say_when_serving(server: Any, line: str) -> None:
    """Print ``line`` once the server answers: its app has started (the ledger open, Ray
    joined) and its socket listens, which takes seconds after the process starts (an
    embedded Ray, most of it); said earlier, a user's first request would find nothing."""
    import time

    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    print_line(line)


def _end_process(code: int) -> None:
    """End the stopped server's process at once with ``code`` (130 after Ctrl-C, as a shell
    reports it). Everything it keeps is closed and on disk
    by now (the ledger, blobs, Ray's processes); what is left is the interpreter's own
    teardown, a full garbage collection over all that torch, onnx and Ray loaded, which
    took 3 s here and would keep a server on Ctrl-C or ``timeout`` alive past the seconds
    a stop is given (docs/api.md, "Restarts"). uvicorn raises Ctrl-C's SIGINT again as
    ``KeyboardInterrupt`` after its shutdown, which would lead into that teardown too."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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


@opt.run_command(server="out", api_key="program", ray_address="transform", mlflow="report_html")
def submit(
    flags: opt.RunFlags,
    server: opt.ServerOpt,
    api_key: opt.ApiKeyOpt = None,
    ray_address: Annotated[str | None, typer.Option(hidden=True, help="Not for submit: the server's setting.")] = None,
    mlflow: opt.MlflowOpt = False,
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
        flags.output_paths(),
    )
    flags.check_openvino(here=False)  # the server makes them (and says if it cannot)
    options = flags.run_options()
    int8_options = flags.int8_options()
    exports = flags.exports()
    model_output = "program" if flags.program is not None else "checkpoint"
    inputs = {name: source for name, source in (("checkpoint", flags.checkpoint), ("program", flags.program),
                                                ("data", data_source), ("eval.data", eval_source))
              if source is not None}
    from bnrecal.service.jobserver.records.spec import JobSpec

    from ..client import input_digests, run_remote_job

    named = input_digests(inputs)
    spec = JobSpec.checked(  # the typed spec, checked here as the server checks its fields (a SpecError names one)
        **options.run_options(), checkpoint=named.get("checkpoint"), program=named.get("program"), data=named["data"],
        outputs=[model_output, *(product.name for product in exports)],
        onnx={"opset": flags.onnx_opset, "dtype": flags.onnx_dtype.value}, int8=int8_options,
        eval={"data": named["eval.data"], "max_samples": flags.eval_max_samples} if eval_source is not None else None,
    )

    tracking = opt.start_tracking(mlflow, flags.out.name, flags)  # before any upload: a store it cannot reach is exit 2
    with opt.tracked_files(tracking, flags.report, flags.report_html) as (report_path, page_path):
        def downloads(job: JobView) -> list[tuple[str, Path]]:
            failed = _int8_failed(job)
            files = [(product.name, ir_archive(path) if product.openvino_ir else path)  # an IR comes as one tar
                     for product, path in exports.items() if not (failed and product.int8)]
            wanted = [(model_output, flags.out), *files, ("report", report_path), ("report.html", page_path)]
            return [(name, path) for name, path in wanted if path is not None]

        with connect(server, api_key) as client, ending(tracking):
            def submitted(job: JobView) -> None:
                typer.echo(job.id)  # the one line on stdout: JOB=$(bnrecal submit ...)
                print_line(f"job {job.id} queued on {client.server}")

            job = run_remote_job(
                client, spec, inputs, follow=progress_bar, downloads=downloads, on_submitted=submitted,
                on_interrupt=lambda job_id: cancel_on_interrupt(client, job_id),
            )
        from bnrecal.service.run.report.document import Report  # the report's types: torch, once the job is done

        report = Report.from_dict(job.report or {})
        int8_failed = _int8_failed(job)
        made = {product: path for product, path in exports.items() if not (int8_failed and product.int8)}
        for product, path in made.items():
            if product.openvino_ir:
                unpack_ir(path)
        if tracking is not None:
            tracking.finish(report, [flags.out, *exports.values(), report_path, page_path])
    also_wrote = (*made.values(), flags.report, flags.report_html)
    for line in summary_lines(report, flags.out, job.id, also_wrote=also_wrote):
        print_line(line)
    if tracking is not None:
        print_line(f"logged MLflow run {tracking.run_id}")
    if int8_failed:  # exit 1, as a local calibrate: the INT8 file asked for was not written
        raise ExportError(report.int8.failure if report.int8 and report.int8.failure else "the INT8 output failed")


def ir_archive(xml: Path | None) -> Path | None:
    """Where an OpenVINO IR artifact (a tar of ``model.xml`` and ``model.bin``) is downloaded
    to, beside the ``.xml`` asked for, before :func:`unpack_ir`."""
    return None if xml is None else xml.with_name(f".{xml.name}.download.tar")


def unpack_ir(xml: Path | None) -> None:
    """Write the downloaded IR's two files as ``xml`` and the ``.bin`` beside it (each whole:
    the weights first) and remove the download; a tar that holds anything else is refused."""
    import tarfile

    from bnrecal.workers.files import atomic_write

    if xml is None:
        return
    archive = ir_archive(xml)
    assert archive is not None
    try:
        with tarfile.open(archive) as tar:
            members = {member.name: member for member in tar.getmembers()}
            if set(members) != {"model.xml", "model.bin"} or not all(m.isfile() for m in members.values()):
                raise ExportError(f"the server's OpenVINO IR holds {sorted(members)}, not model.xml and model.bin")
            parts = {name: tar.extractfile(member).read() for name, member in members.items()}  # type: ignore[union-attr]
    finally:
        archive.unlink(missing_ok=True)
    atomic_write(xml.with_suffix(".bin"), lambda scratch: scratch.write_bytes(parts["model.bin"]))
    atomic_write(xml, lambda scratch: scratch.write_bytes(parts["model.xml"]))


def _int8_failed(job: JobView) -> bool:
    """Whether the job's INT8 file failed its guard: no file then (docs/int8.md)."""
    return ((job.report or {}).get("int8") or {}).get("written") is False


def cancel_on_interrupt(client: BnrecalClient, job_id: str) -> NoReturn:
    """Ctrl-C while following a job (``submit``'s, a sweep's): cancel it on the server, say so, and exit 130."""
    try:
        status = cancel_and_wait(client, job_id)
        outcome = "cancelled" if status == "cancelled" else f"cancel requested ({status})"
        message = f"interrupted: job {job_id} {outcome} on {client.server}"
    except (BnrecalError, KeyboardInterrupt) as exc:
        detail = exc.message if isinstance(exc, BnrecalError) else "interrupted again"
        message = f"interrupted: job {job_id} may still run on {client.server} ({detail}); bnrecal cancel {job_id}"
    fail(message, 130)
