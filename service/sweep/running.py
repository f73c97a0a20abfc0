"""A sweep of files (``bnrecal sweep``): every cell is the single job of its model and set,
``recalibrate_to_files`` as ``bnrecal calibrate`` runs it, on ranks the cells share
(``service.run.shared``): started once, with each set's samples decoded once.

Cells run model by model. A cell that fails (its checkpoint does not fit, its BN cannot be
calibrated, its INT8 file fails its guard) fails alone, with its error; the others run on.
A cancellation stops the sweep: the cells not run are ``cancelled``. After every cell the
matrix report is written again, so ``sweep.json`` always holds what is done.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bnrecal.errors import BnrecalError, CancelledError
from bnrecal.workers.ranks.pool import WarmPool

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.run.core import KeepBudget, ProgressCallback, decoding_report
from bnrecal.service.run.executors import InProcess, RayRanks
from bnrecal.service.run.options import ExportOptions, RunOptions
from bnrecal.service.run.outputs import RunOutputs
from bnrecal.service.run.recalibrate import RecalibrationRequest, RunFiles, recalibrate_to_files
from bnrecal.service.run.report import Report
from bnrecal.service.run.shared import SharedRanks
from bnrecal.service.settings import Settings

from .cells import CalibrationSet, Cell, CellStatus, SweepFiles, SweepModel
from .matrix import CellSummary, SweepReport, relative_link, write_sweep_report

REPORT_NAMES = ("sweep.json", "sweep.csv", "sweep.html")


@dataclass(frozen=True)
class SweepRun:
    """How every cell runs: the run options (``calibrate``'s), the evaluation's sample
    limit, which files each cell writes besides its model and reports (the folded ONNX
    export, the INT8 file), and the metric the matrix ranks by."""

    options: RunOptions
    rank_by: str
    eval_max_samples: int | None = None
    onnx: bool = False
    int8: Int8Options | None = None
    export: ExportOptions = ExportOptions()


@dataclass
class CellResult:
    """A finished cell: its state, its report (None when it failed before it had one), its
    error, its seconds and its folder."""

    cell: Cell
    status: CellStatus
    report: Report | None
    error: BnrecalError | None
    seconds: float
    folder: Path
    model_file: Path | None = None  # its recalibrated model, where it has one


def sweep_to_files(
    sweep: SweepFiles,
    run: SweepRun,
    settings: Settings,
    out_dir: Path,
    *,
    on_cell: Callable[[CellResult], None] | None = None,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    pool: WarmPool | None = None,
) -> SweepReport:
    """Run every cell of ``sweep`` into ``out_dir/<model>/<set>/`` (the model in its uploaded
    format, ``report.json``, ``report.html``, and the ONNX and INT8 files asked for), on
    ranks shared by all cells; ``on_cell`` hears each cell as it finishes. With a warm
    ``pool`` (a server's) the cells run on its ranks, even with one worker. Returns the
    matrix report, written as ``sweep.json``, ``sweep.csv`` and ``sweep.html``."""
    options = run.options
    in_process = options.workers == 1 and not settings.ray_address and pool is None
    inner = InProcess() if in_process else RayRanks(settings, address=settings.ray_address, placement=options.placement,
                                                    pool=pool)
    keep = KeepBudget.from_megabytes(settings.kept_memory_mb, settings.kept_disk_mb)
    shared = SharedRanks(inner, keep)
    sets = {s.name: s for s in sweep.sets}
    report = SweepReport(models=[m.name for m in sweep.models], sets=list(sets), cells=[], rank_by=run.rank_by,
                         workers=options.workers)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cells = list(sweep.cells())
    cancelled: CancelledError | None = None
    pages = _PageWriter()
    try:
        for number, cell in enumerate(cells, 1):
            if cancelled is None and cancel is not None and cancel.is_set():
                cancelled = CancelledError("the sweep was cancelled")
            folder = out_dir / cell.model_name / cell.set_name
            if cancelled is not None:
                result = CellResult(cell, CellStatus.CANCELLED, None, cancelled, 0.0, folder)
            else:
                progress = _cell_progress(on_progress, f"[{number}/{len(cells)} {cell.key}]")
                result = _run_cell(cell, sweep.models[cell.model_index], sets[cell.set_name], run, settings, folder,
                                   shared, progress, cancel)
                if isinstance(result.error, CancelledError):
                    cancelled = result.error
                if result.report is not None:
                    pages.write(result.report, folder / "report.html")
            report.cells.append(cell_summary(result, out_dir))
            report.seconds = round(time.monotonic() - started, 3)
            write_sweep_report(report, out_dir)
            if on_cell is not None:
                on_cell(result)
    finally:
        try:
            counts = shared.finish()
        finally:
            pages.close()
    report.decoding = decoding_report(counts, keep)
    report.seconds = round(time.monotonic() - started, 3)
    write_sweep_report(report, out_dir)
    if cancelled is not None:
        raise cancelled
    return report


def _run_cell(
    cell: Cell, model: SweepModel, calibration: CalibrationSet, run: SweepRun, settings: Settings, folder: Path,
    shared: SharedRanks, on_progress: ProgressCallback | None, cancel: threading.Event | None,
) -> CellResult:
    """One cell: the single job of its model and set, on the shared ranks; its failure is its own."""
    started = time.monotonic()
    try:
        request = RecalibrationRequest.checked(
            **{**run.options.run_options(),  # a program carries its own architecture
               "arch": None if model.program else model.arch or run.options.arch,
               "model_kwargs": {} if model.program else model.model_kwargs or run.options.model_kwargs},
            checkpoint=model.checkpoint, program=model.program, data=calibration.data, eval_data=calibration.eval_data,
            eval_max_samples=calibration.eval_max_samples or run.eval_max_samples, data_name=calibration.data_name,
            eval_data_name=calibration.eval_data_name,
            **{"program_name" if model.program else "checkpoint_name": model.source_name},
        )
        folder.mkdir(parents=True, exist_ok=True)
        source = model.program or model.checkpoint
        assert source is not None
        if model.source_name is not None:
            source = Path(Path(model.source_name).name or source.name)
        outputs = RunOutputs(
            onnx=folder / "model.onnx" if run.onnx else None, int8=folder / "model.int8.onnx" if run.int8 else None,
            int8_options=run.int8, export=run.export,
        )
        files = RunFiles(model=folder / source.name, report=folder / "report.json")  # its page: _PageWriter
        made = recalibrate_to_files(request, settings, outputs, files, on_progress=on_progress, cancel=cancel,
                                    in_process=isinstance(shared.inner, InProcess), int8_field="--int8", shared=shared)
    except BnrecalError as exc:
        status = CellStatus.CANCELLED if isinstance(exc, CancelledError) else CellStatus.FAILED
        return CellResult(cell, status, None, exc, time.monotonic() - started, folder)
    seconds = time.monotonic() - started
    if made.int8_failed is not None:
        return CellResult(cell, CellStatus.FAILED, made.report, made.int8_failed, seconds, folder, files.model)
    return CellResult(cell, CellStatus.SUCCEEDED, made.report, None, seconds, folder, files.model)


def cell_summary(result: CellResult, out_dir: Path) -> CellSummary:
    """A finished cell in the matrix, linked to its own report page where it has one."""
    link = relative_link(result.folder / "report.html", out_dir) if result.report is not None else None
    error = None if result.error is None else result.error.message
    return CellSummary.of(result.cell, result.status, result.report, result.seconds, error, link)


def _cell_progress(on_progress: ProgressCallback | None, label: str) -> ProgressCallback | None:
    """A cell's progress, its phases named after the cell."""
    if on_progress is None:
        return None
    return lambda done, total, phase: on_progress(done, total, f"{label} {phase}")


class _PageWriter:
    """Each cell's ``report.html``, drawn in a thread of this process while the next cell
    runs on the ranks (its charts take a second or two of the host's CPU, which the ranks'
    pass does not wait for), at the lowest priority; :meth:`close` waits for every page and
    raises the first failure."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bnrecal-sweep-pages",
                                        initializer=_lowest_priority)
        self._written: list[Future[None]] = []

    def write(self, report: Report, path: Path) -> None:
        from bnrecal.service.run.report_html import write_html_report  # jinja2 and matplotlib: only for the pages

        self._written.append(self._pool.submit(write_html_report, report, path))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for written in self._written:
            written.result()


def _lowest_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux: an ordinary thread
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
