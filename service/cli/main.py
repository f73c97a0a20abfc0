"""The ``bnrecal`` command line (see the README and ``docs/``): the app, its commands, and
the entry point that turns every failure into one line on stderr and an exit code (``main``;
``script``, the installed executable, which runs it in a process of its own): 2 for
bad input (flags, files, architecture, data), 1 for a run that failed, 130 when
interrupted. Tracebacks only with ``BNRECAL_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys

import typer

from bnrecal.errors import BnrecalError, first_line

from . import collector, jobs, local, remote, storage, sweep
from .console import exit_code, fail
from .options import flag_message

app = typer.Typer(
    name="bnrecal",
    help="Recalibrate the BatchNorm statistics of trained PyTorch models on Ray, and export them folded to ONNX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(asked: bool) -> None:
    if asked:
        from importlib import metadata

        try:
            version = metadata.version("bnrecal")
        except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
            version = "0+unknown"
        print(f"bnrecal {version}")
        raise typer.Exit()


@app.callback()
def _commands(
    context: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", callback=_version,
                                 is_eager=True),
) -> None:
    """Recalibrate BatchNorm statistics on Ray; serve and submit jobs over HTTP."""
    if context.invoked_subcommand not in collector.JOB_COMMANDS:
        collector.resume()  # only a job command keeps it paused over its start-up (collector.py)


app.command()(local.calibrate)
app.command("export")(local.export_command)
app.command("sweep")(sweep.sweep)
app.command()(remote.serve)
app.command()(remote.submit)
app.command("jobs")(jobs.list_jobs)
app.command("status")(jobs.job_status)
app.command("cancel")(jobs.cancel)
app.command("delete")(storage.delete_job)
app.command("gc")(storage.collect_garbage)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``bnrecal`` script: runs the app, turning every error into one line."""
    debug = os.environ.get("BNRECAL_DEBUG") == "1"
    try:
        code = app(args=argv, standalone_mode=False, prog_name="bnrecal")
        if isinstance(code, int) and code:  # a command's typer.Exit(code) is returned, not raised
            raise SystemExit(code)
    except BnrecalError as exc:
        if debug:
            raise
        fail(flag_message(exc), exit_code(exc))
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except typer.Abort:
        fail("interrupted", 130)
    except typer.TyperException as exc:  # usage errors: unknown flag, bad value, missing option
        if type(exc).__name__ == "NoArgsIsHelpError":
            context = getattr(exc, "ctx", None)
            if context is not None:
                print(context.get_help())
            raise SystemExit(0) from None
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        fail(" ".join(message.split()), getattr(exc, "exit_code", 2) or 2)
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - the last line of defence: no traceback for users
        if debug:
            raise
        fail(f"internal error: {type(exc).__name__}: {first_line(exc)} (set BNRECAL_DEBUG=1 for the traceback)", 1)


def script() -> None:
    """The ``bnrecal`` executable (and ``python -m bnrecal.service.cli``): ``main`` on the
    process's arguments, in a process of its own, so a job command's start-up may run with
    the cycle collector paused (``collector``)."""
    collector.pause()
    main(sys.argv[1:])
