"""``bnrecal sweep``: many models over many named calibration sets in one run, each cell the
single ``calibrate`` of its model and set (docs/sweeps.md)."""

from __future__ import annotations

import threading
from dataclasses import MISSING
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bnrecal.errors import InputError, SpecError

from bnrecal.service.export.products import PRODUCTS, ExportProduct
from bnrecal.service.run.options import STARTING_PHASE
from bnrecal.service.tracking import ending

from . import collector
from . import options as opt
from .console import print_line

if TYPE_CHECKING:
    from bnrecal.service.export.int8.options import Int8Options
    from bnrecal.service.run.options import RunOptions
    from bnrecal.service.settings import Settings
    from bnrecal.service.sweep.cells import SweepFiles, SweepModel
    from bnrecal.service.sweep.matrix import SweepReport

ModelsOpt = Annotated[
    Path, typer.Option(metavar="MANIFEST", help="Models manifest: one a line, a checkpoint path (with --arch), a .pt2 program path, or "
                            'a JSON object {"checkpoint"|"program", "arch", "model_kwargs", "name"}.')
]
SetsOpt = Annotated[
    list[str], typer.Option("--data", metavar="NAME=PATH", help="A calibration set as NAME=PATH (repeat for several; one PATH alone is "
                                          "the set named data).")
]
EvalSetsOpt = Annotated[
    list[str] | None, typer.Option("--eval-data", metavar="NAME=PATH", help="A set's evaluation data as NAME=PATH (NAME: a --data set's).")
]
OutDirOpt = Annotated[Path, typer.Option(help="Folder for every cell's files (<model>/<set>/) and sweep.json, "
                                              "sweep.csv, sweep.html.")]
PairsOpt = Annotated[Path | None, typer.Option(metavar="FILE", help="Run only these cells: one 'MODEL SET' (names) a line.")]
CellsAtOnceOpt = Annotated[int, typer.Option(
    min=1, max=64, metavar="N", help="Run N cells side by side, each on its own --workers ranks (N x --workers in all).")]
RankByOpt = Annotated[str | None, typer.Option(
    metavar="METRIC", help="Rank the cells by: after_top1 (default with evaluation data), worst_drift (default without), "
         "top1_gain, before_top1, int8_top1, prediction_change, seconds.")]


SweepFlags = opt.flags_class(
    "SweepFlags",
    """The flags of ``bnrecal sweep``: the models and sets, then ``calibrate``'s run options.""",
    [
        ("models", ModelsOpt, MISSING),
        ("data", SetsOpt, MISSING),
        ("out_dir", OutDirOpt, MISSING),
        ("eval_data", EvalSetsOpt, None),
        ("pairs", PairsOpt, None),
        ("arch", opt.ArchOpt, None),
        ("model_kwargs", opt.ModelKwargsOpt, None),
        *opt.RECALIBRATION_FLAGS,
        ("eval_max_samples", opt.EvalMaxSamplesOpt, None),
        *((product.name, opt.cell_flag(product), False) for product in PRODUCTS),  # --onnx, --onnx-int8, ...
        ("onnx_opset", opt.OnnxOpsetOpt, opt.OPSET),
        ("onnx_dtype", opt.OnnxDtypeOpt, opt.OnnxDtype.float32),
        ("int8", opt.Int8Opt, None),
        ("rank_by", RankByOpt, None),
        ("cells_at_once", CellsAtOnceOpt, 1),
    ],
    opt.RunOptionFlags,
    __name__,
)


SweepServerOpt = Annotated[str | None, typer.Option(
    metavar="URL", help="Run the sweep as one job on this bnrecal server (uploads what it lacks; the files land in "
                        "--out-dir as they would here).")]


@opt.run_command(SweepFlags, ray_address="transform", server="transform", api_key="transform", mlflow="cells_at_once")
def sweep(
    flags: SweepFlags,
    ray_address: Annotated[str | None, typer.Option(help="Existing Ray cluster (default: RAY_ADDRESS or embedded).")] = None,
    server: SweepServerOpt = None,
    api_key: opt.ApiKeyOpt = None,
    mlflow: Annotated[bool, typer.Option("--mlflow", help="Log the sweep to MLflow: a parent run, a child run per cell "
                                                          "with its report and files (see calibrate --mlflow).")] = False,
) -> None:
    """Recalibrate many models (--models MANIFEST) over many calibration sets (--data NAME=PATH,
    repeated) in one run: ranks start once, each set is decoded once, and every cell (a model
    and a set) is the single calibrate of it; here, or with --server as one job on a server.
    Exit 0 when every cell succeeded, 1 when some failed (each named on stderr)."""
    from bnrecal.service.sweep.cells import SweepFiles
    from bnrecal.service.sweep.inputs import as_sets, calibration_sets, read_manifest, read_pairs
    from bnrecal.service.sweep.matrix import check_metric

    from ..settings import Settings
    from .console import parse_json_object

    opt.check_paths({"--models": flags.models, "--pairs": flags.pairs})
    if flags.out_dir.exists() and not flags.out_dir.is_dir():
        raise SpecError(f"--out-dir {flags.out_dir}: is a file; give a folder", field="--out-dir")
    opt.check_paths({}, {"--out-dir": None if flags.out_dir.exists() else flags.out_dir})  # the folder it is made in
    sets = calibration_sets(flags.data, flags.eval_data or [])
    opt.check_paths({f"--data {name}": path for name, path, _ in sets if "://" not in path})
    opt.check_paths({f"--eval-data {name}": path for name, _, path in sets if path and "://" not in path})
    models = read_manifest(flags.models, arch=flags.arch, model_kwargs=parse_json_object(flags.model_kwargs,
                                                                                         "--model-kwargs") or {})
    names = [model.name for model in models]
    pairs = read_pairs(flags.pairs, names, [name for name, _, _ in sets]) if flags.pairs is not None else None
    labelled = any(evaluation for _, _, evaluation in sets)
    rank_by = check_metric(flags.rank_by or ("after_top1" if labelled else "worst_drift"), "--rank-by")
    quantizes = any(product.int8 for product in _products(flags))
    if flags.int8 is not None and not quantizes:
        raise SpecError("--int8 sets the INT8 export's options: give --onnx-int8 or --openvino-int8 too", field="--int8")
    if server is None:
        _check_openvino(flags)
    int8 = None
    if quantizes:
        from bnrecal.service.export.int8.options import int8_options

        int8 = int8_options(parse_json_object(flags.int8, "--int8"), "--int8")
    if int8 is not None and int8.max_top1_drop is not None and not labelled:
        raise SpecError("--int8 max_top1_drop needs --eval-data (labelled) to measure top-1 on", field="--eval-data")
    options = flags.run_options()
    if server is not None and ray_address:
        raise SpecError("--ray-address does not go with --server: the server picks its cluster", field="--ray-address")
    settings = Settings()
    if ray_address:
        settings = settings.model_copy(update={"ray_address": ray_address})
    if server is None:
        _check_architectures(models, settings)
    sweep_files = SweepFiles(models, as_sets([(n, opt.data_source(d, "--data"), opt.data_source(e, "--eval-data"))
                                              for n, d, e in sets]), pairs)
    tracking = opt.start_tracking(mlflow, f"sweep {flags.out_dir.name}", flags)  # before any work: exit 2 if unreachable
    with ending(tracking):
        if server is not None:
            from .sweep_remote import RemoteSweep, sweep_on_server

            collector.resume()  # no job starts here: the server runs it, this process uploads and follows it
            report = sweep_on_server(RemoteSweep(sweep_files, options, rank_by, flags.eval_max_samples, _outputs(flags),
                                                 int8, flags.onnx_opset, flags.onnx_dtype.value, flags.cells_at_once),
                                     server, api_key, flags.out_dir)
        else:
            report = _sweep_here(flags, sweep_files, options, rank_by, int8, settings)
    if tracking is not None:
        from bnrecal.service.tracking import log_sweep

        log_sweep(tracking, report, flags.out_dir, opt.flag_params(flags))
        print_line(f"logged MLflow run {tracking.run_id} (a child run per cell)")
    _finish(report, flags.out_dir)


def _sweep_here(flags: SweepFlags, sweep_files: SweepFiles, options: RunOptions, rank_by: str,
                int8: Int8Options | None, settings: Settings) -> SweepReport:
    """Run the checked sweep on this machine's (or ``--ray-address``'s) Ray, with its progress
    line, stopping the Ray it started; return its matrix report."""
    from bnrecal.service.run.options import ExportOptions
    from bnrecal.service.run.progress import progress_bar
    from bnrecal.service.sweep.running import SweepRun, sweep_to_files  # the input is fine: now torch

    from .local import finish_ray, ray_connected

    run = SweepRun(options=options, rank_by=rank_by, eval_max_samples=flags.eval_max_samples, outputs=_outputs(flags),
                   int8=int8, export=ExportOptions(opset=flags.onnx_opset, dtype=flags.onnx_dtype.value),
                   cells_at_once=flags.cells_at_once)
    cancel = threading.Event()
    connected_before = (options.workers == 1 and flags.cells_at_once == 1 and not settings.ray_address) or ray_connected()
    with progress_bar(STARTING_PHASE) as shown:
        update = collector.resumed_at_first_phase(shown)
        try:
            report = sweep_to_files(sweep_files, run, settings, flags.out_dir, on_progress=update, cancel=cancel)
        except KeyboardInterrupt:
            cancel.set()
            raise
        finally:
            if not connected_before:
                finish_ray(update)
    return report


def _products(flags: SweepFlags) -> tuple[ExportProduct, ...]:
    """The files each cell writes besides its model and reports, by their flags."""
    return tuple(product for product in PRODUCTS if getattr(flags, product.name))


def _outputs(flags: SweepFlags) -> frozenset[str]:
    """The names of the files each cell writes besides its model and reports."""
    return frozenset(product.name for product in _products(flags))


def _check_openvino(flags: SweepFlags) -> None:
    """Refuse OpenVINO IR cells when OpenVINO is not installed here, before any work."""
    from bnrecal.service.export.runtimes import openvino_version

    for product in _products(flags):
        if product.openvino_ir and openvino_version() is None:
            raise SpecError(f"{product.flag} needs OpenVINO: pip install 'bnrecal[openvino]'", field=product.flag)


def _check_architectures(models: list[SweepModel], settings: Settings) -> None:
    """Refuse a sweep one of whose architectures cannot be built here (outside
    ``BNRECAL_MODEL_MODULES``, an unknown name) before any work, naming the model: a whole
    sweep's mistake, not one cell's (a server checks its own allowlist at submission)."""
    from bnrecal.workers.models.architectures import check_architecture_exists

    for arch in dict.fromkeys(model.arch for model in models if model.arch and not model.program):
        try:
            check_architecture_exists(arch, settings.model_modules)
        except InputError as exc:
            named = next(model.name for model in models if model.arch == arch)
            raise SpecError(f"--models: model {named}: {exc.message}", field="--models") from None


def _finish(report: SweepReport, out_dir: Path) -> None:
    """Say what the sweep came to; exit 1 when some cells failed, each named on stderr."""
    print_line(
        f"swept {len(report.models)} models x {len(report.sets)} sets: {report.succeeded} cells succeeded, "
        f"{report.failed} failed in {report.seconds:.1f} s; wrote {out_dir}/sweep.json, sweep.csv, sweep.html"
    )
    for cell in report.cells:
        if cell.status.value != "succeeded":
            typer.echo(f"cell {cell.model}/{cell.set_name} {cell.status.value}: {cell.error}", err=True)
    if report.failed:
        raise typer.Exit(1)
