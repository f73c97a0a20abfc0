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
from bnrecal.workers.data.reading.kept import KeptCounts
from bnrecal.workers.ranks.gangs.pool import WarmPool
from bnrecal.workers.ranks.gangs.warm_context import current_pool

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.products import PRODUCTS, products_of
from bnrecal.service.run.core import KeepBudget, ProgressCallback, decoding_report
from bnrecal.service.run.executors import InProcess, RayRanks
from bnrecal.service.run.options import ExportOptions, RunOptions
from bnrecal.service.run.outputs.later_phases import RunOutputs
from bnrecal.service.run.recalibrate import RecalibrationRequest, RunFiles, recalibrate_to_files
from bnrecal.service.run.report.document import DecodingReport, Report
from bnrecal.service.run.shared import SharedRanks
from bnrecal.service.settings import Settings

from .cells import CalibrationSet, Cell, CellStatus, SweepFiles, SweepModel
from .matrix import CellSummary, SweepReport, relative_link, write_sweep_report

REPORT_NAMES = ("sweep.json", "sweep.csv", "sweep.html")

CELL_FILES = {product.name: product.cell_file for product in PRODUCTS}
"""The files a cell writes besides its model and reports, by product name (the job spec's
outputs): the folded ONNX export, the INT8 file, and OpenVINO's files of each (an ``.xml``
and the ``.bin`` beside it)."""


@dataclass(frozen=True)
class SweepRun:
    """How every cell runs: the run options (``calibrate``'s), the evaluation's sample
    limit, which files each cell writes besides its model and reports (names of
    ``CELL_FILES``), the INT8 phase's options (with an INT8 output), and the metric the
    matrix ranks by."""

    options: RunOptions
    rank_by: str
    eval_max_samples: int | None = None
    outputs: frozenset[str] = frozenset()
    int8: Int8Options | None = None
    export: ExportOptions = ExportOptions()
    cells_at_once: int = 1
    """Cells run side by side, each on its own ``options.workers`` ranks."""

    def __post_init__(self) -> None:
        unknown = sorted(self.outputs - CELL_FILES.keys())
        if unknown:
            raise ValueError(f"no such cell output: {', '.join(unknown)} (one of {', '.join(CELL_FILES)})")
        if (self.int8 is not None) != any(product.int8 for product in products_of(self.outputs)):
            raise ValueError("the INT8 options go with an INT8 output (onnx_int8, openvino_int8), and only with one")

    def cell_outputs(self, folder: Path) -> RunOutputs:
        """What one cell makes, in its ``folder``."""
        return RunOutputs.named({name: folder / CELL_FILES[name] for name in self.outputs}, self.export, self.int8)


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
    format, ``report.json``, ``report.html``, and the ``CELL_FILES`` asked for), on
    ranks shared by all cells; ``on_cell`` hears each cell as it finishes. With a warm
    ``pool`` (a server's) the cells run on its ranks, even with one worker. With
    ``run.cells_at_once`` N, N cells run side by side, each lane on its own ranks (each lane
    decodes a set once). Returns the matrix report, written as ``sweep.json``, ``sweep.csv``
    and ``sweep.html``."""
    options = run.options
    lanes = max(1, run.cells_at_once)
    in_process = options.workers == 1 and not settings.ray_address and pool is None and lanes == 1
    keep = KeepBudget.from_megabytes(settings.kept_memory_mb, settings.kept_disk_mb)

    def ranks() -> SharedRanks:
        inner = InProcess() if in_process else RayRanks(settings, address=settings.ray_address,
                                                        placement=options.placement,
                                                        pool=pool if pool is not None else current_pool())
        return SharedRanks(inner, keep)

    if lanes > 1 and pool is None:  # one Ray for every lane, with room for all their ranks
        from bnrecal.service.run.cluster import ensure_ray
        from bnrecal.service.run.executors import cpus_per_worker

        # each rank keeps the CPUs (torch threads) of its single job, so its sums stay bit for bit
        ensure_ray(settings.ray_address, min_cpus=cpus_per_worker(settings, options.workers) * options.workers * lanes)
    sweeping = _Sweeping(sweep, run, settings, out_dir, on_cell, on_progress, cancel)
    shared = [ranks() for _ in range(lanes)]
    counts = KeptCounts()
    try:
        if lanes == 1:
            sweeping.lane(shared[0])
        else:
            with ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="bnrecal-sweep-lane") as threads:
                for lane in [threads.submit(sweeping.lane, ranks) for ranks in shared]:
                    lane.result()
        sweeping.cancel_the_rest()
    finally:
        try:
            for ranks in shared:
                counts = counts + ranks.finish()
        finally:
            sweeping.pages.close()
    return sweeping.end(decoding_report(counts, keep))


class _Sweeping:
    """A sweep under way: the cells not yet taken, handed to the lanes one at a time, and the
    matrix report, written again as each cell finishes (one lane at a time)."""

    def __init__(
        self, sweep: SweepFiles, run: SweepRun, settings: Settings, out_dir: Path,
        on_cell: Callable[[CellResult], None] | None, on_progress: ProgressCallback | None,
        cancel: threading.Event | None,
    ) -> None:
        self.sweep, self.run, self.settings, self.out_dir = sweep, run, settings, out_dir
        self.on_cell, self.on_progress, self.cancel = on_cell, on_progress, cancel
        self.sets = {s.name: s for s in sweep.sets}
        self.cells = list(sweep.cells())
        self.report = SweepReport(models=[m.name for m in sweep.models], sets=list(self.sets), cells=[],
                                  rank_by=run.rank_by, workers=run.options.workers)
        self.pages = _PageWriter()
        self.cancelled: CancelledError | None = None
        self.started = time.monotonic()
        self._next = 0
        self._lock = threading.Lock()
        out_dir.mkdir(parents=True, exist_ok=True)

    def lane(self, shared: SharedRanks) -> None:
        """Run cells on ``shared`` until none is left (or the sweep is cancelled)."""
        while (taken := self._take()) is not None:
            number, cell = taken
            progress = _cell_progress(self.on_progress, f"[{number}/{len(self.cells)} {cell.key}]")
            folder = self.out_dir / cell.model_name / cell.set_name
            try:
                result = _run_cell(cell, self.sweep.models[cell.model_index], self.sets[cell.set_name], self.run,
                                   self.settings, folder, shared, progress, self.cancel)
            except BaseException:
                with self._lock:  # a bug: the other lanes take no more cells
                    self.cancelled = self.cancelled or CancelledError("the sweep stopped: another cell raised")
                raise
            self._finished(result)

    def _take(self) -> tuple[int, Cell] | None:
        with self._lock:
            if self._next >= len(self.cells):
                return None
            if self.cancelled is None and self.cancel is not None and self.cancel.is_set():
                self.cancelled = CancelledError("the sweep was cancelled")
            if self.cancelled is not None:
                return None
            self._next += 1
            return self._next, self.cells[self._next - 1]

    def _finished(self, result: CellResult) -> None:
        with self._lock:
            if isinstance(result.error, CancelledError):
                self.cancelled = self.cancelled or result.error
            if result.report is not None:
                self.pages.write(result.report, result.folder / "report.html")
            self.report.cells.append(cell_summary(result, self.out_dir))
            self.report.seconds = round(time.monotonic() - self.started, 3)
            write_sweep_report(self.report, self.out_dir)
            if self.on_cell is not None:
                self.on_cell(result)

    def cancel_the_rest(self) -> None:
        """The cells no lane took, ``cancelled`` (none when the sweep ran to its end)."""
        while self.cancelled is not None and (taken := self._take_any()) is not None:
            cell = taken
            folder = self.out_dir / cell.model_name / cell.set_name
            self._finished(CellResult(cell, CellStatus.CANCELLED, None, self.cancelled, 0.0, folder))

    def _take_any(self) -> Cell | None:
        with self._lock:
            if self._next >= len(self.cells):
                return None
            self._next += 1
            return self.cells[self._next - 1]

    def end(self, decoding: DecodingReport) -> SweepReport:
        """Write the finished matrix (with what the ranks decoded and kept); raise the
        cancellation that stopped the sweep, if one did."""
        self.report.decoding = decoding
        self.report.seconds = round(time.monotonic() - self.started, 3)
        write_sweep_report(self.report, self.out_dir)
        if self.cancelled is not None:
            raise self.cancelled
        return self.report


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
        outputs = run.cell_outputs(folder)
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
        from bnrecal.service.run.report.page import write_html_report  # jinja2 and matplotlib: only for the pages

        self._written.append(self._pool.submit(write_html_report, report, path))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for written in self._written:
            written.result()


def _lowest_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux: an ordinary thread
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
