"""The ``bnrecal`` command line (contract section 4).

Every failure ends in one line on stderr and an exit code: 2 for bad input (flags,
files, architecture, data), 1 for a run that failed. Tracebacks only with
``BNRECAL_DEBUG=1``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from workers.errors import BnrecalError, SpecError

from . import cli_options as opt

app = typer.Typer(
    name="bnrecal",
    help="Recalibrate the BatchNorm statistics of trained PyTorch models on Ray, and export them folded to ONNX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
stderr = Console(stderr=True)


def parse_json_object(value: str | None, option: str) -> dict[str, Any] | None:
    """Parse a JSON object given on the command line, naming the option when it is not one."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{option} is not valid JSON: {exc.msg} at position {exc.pos}", field=option) from None
    if not isinstance(parsed, dict):
        raise SpecError(f"{option} must be a JSON object, got {type(parsed).__name__}", field=option)
    return parsed


@contextmanager
def progress_bar(description: str) -> Iterator[Any]:
    """A progress bar on a terminal; a silent callback elsewhere (pipes, CI logs)."""
    if not stderr.is_terminal:
        yield lambda done, total: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr, transient=False) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@app.callback()
def _commands() -> None:
    """Recalibrate BatchNorm statistics on Ray; serve and submit jobs over HTTP."""


@app.command()
def calibrate(
    arch: opt.ArchOpt,
    checkpoint: opt.CheckpointOpt,
    data: opt.DataOpt,
    out: opt.OutOpt,
    model_kwargs: opt.ModelKwargsOpt = None,
    workers: opt.WorkersOpt = 1,
    batch_size: opt.BatchOpt = 32,
    mode: opt.ModeOpt = opt.Mode.sync,
    max_samples: opt.MaxSamplesOpt = None,
    device: opt.DeviceOpt = opt.Device.cpu,
    transform: opt.TransformOpt = None,
    ray_address: Annotated[str | None, typer.Option(help="Existing Ray cluster (default: RAY_ADDRESS or embedded).")] = None,
    placement: opt.PlacementOpt = None,
    max_retries: opt.MaxRetriesOpt = None,
    onnx: opt.OnnxOpt = None,
    onnx_opset: opt.OnnxOpsetOpt = 18,
    onnx_dtype: opt.OnnxDtypeOpt = opt.OnnxDtype.float32,
    report: opt.ReportOpt = None,
) -> None:
    """Recalibrate a checkpoint's BatchNorm statistics on calibration data."""
    from .recalibrate import RecalibrationRequest, recalibrate
    from .settings import Settings

    settings = Settings()
    if ray_address:
        settings = settings.model_copy(update={"ray_address": ray_address})
    request = RecalibrationRequest(
        arch=arch,
        checkpoint=checkpoint,
        data=data,
        model_kwargs=parse_json_object(model_kwargs, "--model-kwargs") or {},
        workers=workers,
        batch_size=batch_size,
        mode=mode.value,
        max_samples=max_samples,
        device=device.value,
        transform=parse_json_object(transform, "--transform"),
        placement=placement.value if placement is not None else None,
        max_retries=max_retries,
    )
    cancel = threading.Event()
    with progress_bar("calibrating") as update:
        try:
            result = recalibrate(request, settings, on_progress=update, cancel=cancel)
        except KeyboardInterrupt:
            cancel.set()
            raise
    if onnx is not None:
        from .exporting import export_recalibrated

        result.report["onnx"] = export_recalibrated(result, onnx, opset=onnx_opset, dtype=onnx_dtype.value)
    result.save_checkpoint(out)
    if report is not None:
        result.save_report(report)
    summary = result.report
    stderr.print(
        f"recalibrated {len(summary['layers'])} BN layers on {summary['samples']} samples "
        f"({summary['world_size']} x {summary['backend']}, {summary['mode']}) "
        f"in {summary['seconds']:.2f} s -> {out}",
        highlight=False,
    )


@app.command("export")
def export_command(
    arch: opt.ArchOpt,
    checkpoint: Annotated[Path, typer.Option(help="Checkpoint to fold and export as it is.")],
    out: Annotated[Path, typer.Option(help="Where to write the .onnx file.")],
    data: Annotated[Path | None, typer.Option(help="Samples to verify the export on (.npy/.npz, images).")] = None,
    input_shape: Annotated[str | None, typer.Option(help="Per-sample shape, e.g. 3,224,224 (without --data).")] = None,
    model_kwargs: opt.ModelKwargsOpt = None,
    transform: opt.TransformOpt = None,
    opset: Annotated[int, typer.Option(help="ONNX opset.")] = 18,
    onnx_dtype: opt.OnnxDtypeOpt = opt.OnnxDtype.float32,
    report: Annotated[Path | None, typer.Option(help="Where to write the export report (JSON).")] = None,
) -> None:
    """Fold BatchNorm into the convolutions and export a checkpoint to ONNX, without recalibrating."""
    from .exporting import export_checkpoint
    from .report import write_report
    from .settings import Settings

    shape = parse_shape(input_shape) if input_shape else None
    result = export_checkpoint(
        arch, checkpoint, out, Settings(), model_kwargs=parse_json_object(model_kwargs, "--model-kwargs"),
        data=data, transform=parse_json_object(transform, "--transform"), input_shape=shape,
        opset=opset, dtype=onnx_dtype.value,
    )
    if report is not None:
        write_report(result, report)
    section = result["onnx"]
    stderr.print(
        f"exported {out}: {section['folded']} BN folded, {section['batchnorm_nodes']} left, "
        f"max abs diff {section['max_abs_diff']:.2e}",
        highlight=False,
    )


def parse_shape(value: str) -> tuple[int, ...]:
    """Parse ``3,224,224`` into a per-sample shape, naming the option when it is not one."""
    try:
        shape = tuple(int(part) for part in value.replace("x", ",").split(","))
    except ValueError:
        raise SpecError(f"--input-shape must be comma-separated integers, got {value!r}", field="input_shape") from None
    if not shape or min(shape) < 1:
        raise SpecError(f"--input-shape must be positive integers, got {value!r}", field="input_shape")
    return shape


def fail(message: str, code: int) -> NoReturn:
    """Print one error line and exit."""
    stderr.print(f"error: {message}", highlight=False, markup=False, soft_wrap=True)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``bnrecal`` script: runs the app, turning every error into one line."""
    debug = os.environ.get("BNRECAL_DEBUG") == "1"
    try:
        app(args=argv, standalone_mode=False, prog_name="bnrecal")
    except BnrecalError as exc:
        if debug:
            raise
        fail(exc.message, exc.exit_code)
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
        detail = (str(exc).strip().splitlines() or [""])[0]
        fail(f"internal error: {type(exc).__name__}: {detail} (set BNRECAL_DEBUG=1 for the traceback)", 1)


from .cli_http import register_http_commands; register_http_commands(app)  # noqa: E402, E702 - serve, submit

if __name__ == "__main__":
    main(sys.argv[1:])
