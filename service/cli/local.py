"""The commands that run here: ``calibrate`` (on an embedded or given Ray cluster) and
``export`` (fold a checkpoint to ONNX as it is)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bnrecal.errors import SpecError

from bnrecal.service.run.options import STARTING_PHASE
from bnrecal.service.run.progress import progress_bar
from bnrecal.service.tracking import ending

from . import collector
from . import options as opt
from .console import int8_line, parse_json_object, parse_shape, print_line, summary_lines

if TYPE_CHECKING:
    from bnrecal.service.run.outputs.later_phases import RunOutputs
    from bnrecal.service.run.recalibrate import Recalibration, RecalibrationRequest, RunFiles
    from bnrecal.service.settings import Settings


@opt.run_command(ray_address="transform", mlflow="report_html")
def calibrate(
    flags: opt.RunFlags,
    ray_address: Annotated[str | None, typer.Option(help="Existing Ray cluster (default: RAY_ADDRESS or embedded).")] = None,
    mlflow: opt.MlflowOpt = False,
) -> None:
    """Recalibrate the BatchNorm statistics of a checkpoint (--arch, --checkpoint) or of a
    torch.export program (--program) on calibration data (and with --eval-data, show what
    it changed)."""
    from ..settings import Settings

    flags.check_model()
    opt.check_paths(
        {"--checkpoint": flags.checkpoint, "--program": flags.program, "--data": flags.data, "--eval-data": flags.eval_data},
        flags.output_paths(),
    )
    flags.check_openvino(here=True)
    int8_options = flags.int8_options()
    if int8_options is not None and int8_options.max_top1_drop is not None and flags.eval_data is None:
        raise SpecError("--int8 max_top1_drop needs --eval-data (labelled) to measure top-1 on", field="--eval-data")
    settings = Settings()
    if ray_address:
        settings = settings.model_copy(update={"ray_address": ray_address})
    options = flags.run_options()
    from bnrecal.service.run.options import ExportOptions
    from bnrecal.service.run.outputs.later_phases import RunOutputs
    from bnrecal.service.run.recalibrate import RecalibrationRequest, RunFiles  # the flags are fine: now load torch

    request = RecalibrationRequest(
        **options.run_options(), checkpoint=flags.checkpoint, program=flags.program,
        data=opt.data_source(flags.data, "--data"), eval_data=opt.data_source(flags.eval_data, "--eval-data"),
        eval_max_samples=flags.eval_max_samples,
    )
    exports = flags.exports()
    outputs = RunOutputs.named({product.name: path for product, path in exports.items()},
                               ExportOptions(opset=flags.onnx_opset, dtype=flags.onnx_dtype.value), int8_options)
    tracking = opt.start_tracking(mlflow, flags.out.name, flags)  # before any worker: a store it cannot reach is exit 2
    with opt.tracked_files(tracking, flags.report, flags.report_html) as (report_path, page_path):
        files = RunFiles(model=flags.out, report=report_path, report_html=page_path)
        with ending(tracking):
            result = _calibrate(request, settings, outputs, files)
        if tracking is not None:
            tracking.finish(result.report, [flags.out, *exports.values(), report_path, page_path])
    int8_failed = result.int8_failed
    written = [path for product, path in exports.items() if int8_failed is None or not product.int8]
    also_wrote = (*written, flags.report, flags.report_html)
    for line in summary_lines(result.report, flags.out, also_wrote=also_wrote):
        print_line(line)
    if tracking is not None:
        print_line(f"logged MLflow run {tracking.run_id}")
    if int8_failed is not None:
        raise int8_failed  # exit 1: the INT8 file asked for was not written


def _calibrate(request: RecalibrationRequest, settings: Settings, outputs: RunOutputs, files: RunFiles) -> Recalibration:
    """Run ``calibrate``'s job with its progress line, stopping the Ray it started."""
    from bnrecal.service.run.recalibrate import recalibrate_to_files

    cancel = threading.Event()
    in_process = request.workers == 1 and not settings.ray_address  # no Ray for one worker (docs/cli.md, "One worker, no Ray")
    connected_before = in_process or ray_connected()
    with progress_bar(STARTING_PHASE) as shown:
        update = collector.resumed_at_first_phase(shown)
        # The run holds its ranks from the statistics to its last INT8 pass (workers.ranks.gangs.job_gang).
        try:
            result = recalibrate_to_files(
                request, settings, outputs, files, on_progress=update, cancel=cancel, in_process=in_process,
                int8_field="--int8",
            )
        except KeyboardInterrupt:
            cancel.set()
            raise
        if not connected_before:  # an instance this command started takes seconds to stop: before the summary
            finish_ray(update)
    return result


def ray_connected() -> bool:
    """Whether this process was connected to Ray before the command (then it stays connected)."""
    import ray

    return ray.is_initialized()


def finish_ray(update: Callable[[int, int | None, str], None]) -> None:
    """Stop the Ray instance this command started (or leave the cluster it joined), saying so
    on the progress line: it takes seconds, and comes before the command's summary."""
    import ray

    update(0, 1, "stopping Ray")
    if ray.is_initialized():
        ray.shutdown()
    update(1, 1, "stopping Ray")


def export_command(
    arch: Annotated[str, typer.Option(help="torchvision:<name>, timm:<name> or <module.path>:<callable>.")],
    checkpoint: Annotated[Path, typer.Option(help="Checkpoint to fold and export as it is.")],
    out: Annotated[Path, typer.Option(help="Where to write the .onnx file.")],
    data: Annotated[Path | None, typer.Option(help="Samples to verify the export on (.npy/.npz, images).")] = None,
    input_shape: Annotated[str | None, typer.Option(help="Per-sample shape, e.g. 3,224,224 (without --data).")] = None,
    model_kwargs: opt.ModelKwargsOpt = None,
    transform: opt.TransformOpt = None,
    opset: Annotated[int, typer.Option(help="ONNX opset.")] = opt.OPSET,
    onnx_dtype: opt.OnnxDtypeOpt = opt.OnnxDtype.float32,
    report: Annotated[Path | None, typer.Option(help="Where to write the export report (JSON).")] = None,
    onnx_int8: opt.OnnxInt8Opt = None,
    int8: opt.Int8Opt = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Batch of the INT8 range pass.", min=1)] = 32,
) -> None:
    """Fold BatchNorm into the convolutions and export a checkpoint to ONNX, without recalibrating
    (with --onnx-int8 and --data, also quantized to INT8 with ranges from that data)."""
    from ..settings import Settings

    shape = parse_shape(input_shape) if input_shape else None
    kwargs, transform_values = parse_json_object(model_kwargs, "--model-kwargs"), parse_json_object(transform, "--transform")
    opt.check_paths({"--checkpoint": checkpoint, "--data": data},
                    {"--out": out, "--onnx-int8": onnx_int8, "--report": report})
    int8_options = opt.int8_options(onnx_int8, int8)
    if onnx_int8 is not None and data is None:
        raise SpecError("--onnx-int8 needs --data: the samples its activation ranges come from", field="--data")
    if onnx_int8 is not None and onnx_dtype.value != "float32":
        raise SpecError("--onnx-int8 quantizes a float32 export: drop --onnx-dtype float16", field="--onnx-dtype")
    from bnrecal.service.run.outputs.exports import export_checkpoint  # the flags are fine: now load torch
    from bnrecal.service.run.report.document import write_report

    result = export_checkpoint(
        arch, checkpoint, out, Settings(), model_kwargs=kwargs, data=data, transform=transform_values, input_shape=shape,
        opset=opset, dtype=onnx_dtype.value,
    )
    if onnx_int8 is not None:
        from bnrecal.service.run.outputs.int8 import quantize_file

        assert data is not None
        result.int8 = quantize_file(
            out, data, onnx_int8, int8_options, Settings(), transform=transform_values, batch_size=batch_size,
        )
    if report is not None:
        write_report(result, report)
    section = result.onnx
    print_line(
        f"exported {out}: {section.folded} BN folded, {section.batchnorm_nodes} left, "
        f"max abs diff {section.max_abs_diff:.2e}",
    )
    if result.int8 is not None:
        print_line(int8_line(result.int8, onnx_int8))
