"""One server job's driver work, as the job host runs it: recalibrate, export, write the files;
or a sweep's, every cell the single job of its model and set (docs/sweeps.md).

The files go into the job's work folder; the server adopts them as the tenant's blobs.
Progress and phases go to ``report`` as (done, total, phase) events, (None, None, phase)
for a phase without samples; a sweep's finished cell as a :class:`CellDone`, whose files
the server adopts at once.
"""

from __future__ import annotations

import threading
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bnrecal.workers.ranks.gangs.pool import WarmPool

from bnrecal.service.export.int8.options import int8_options
from bnrecal.service.run.core import check_cancel
from bnrecal.service.run.options import ExportOptions
from bnrecal.service.run.outputs.later_phases import RunOutputs
from bnrecal.service.run.recalibrate import RecalibrationRequest, RunFiles, recalibrate_to_files
from bnrecal.service.run.report.page import JobLabel
from bnrecal.service.sweep.matrix import CellSummary, check_metric
from bnrecal.service.sweep.cells import SweepFiles
from bnrecal.service.sweep.running import CellResult, SweepRun, cell_summary, sweep_to_files
from bnrecal.service.export.products import ExportProduct, products_of
from bnrecal.errors import RunError

from bnrecal.service.settings import Settings
from bnrecal.service.jobserver.records.spec import JobSpec

OCTET_STREAM = "application/octet-stream"
TAR = "application/x-tar"

JSON = "application/json"
HTML = "text/html; charset=utf-8"


@dataclass(frozen=True)
class CellDone:
    """A sweep's cell that finished: its summary in the matrix, and its files as artifacts
    (``<model>/<set>/checkpoint``, ...; its ``report.html`` comes with the sweep's end)."""

    summary: CellSummary
    files: dict[str, tuple[Path, str]] = field(default_factory=dict)


Event = tuple[int | None, int | None, str] | CellDone
"""A job's progress as the host reports it: (samples done, samples total, phase), or
(None, None, phase) when the job entered a phase without samples (exporting, writing), or a
sweep's finished cell."""


@dataclass(frozen=True)
class JobFiles:
    """What a job left in its work folder: artifact name -> (file, media type), and the report;
    ``failed`` is a sweep's error when some of its cells failed (its files stand all the same)."""

    files: dict[str, tuple[Path, str]]
    report: dict[str, Any]
    failed: RunError | None = None


@dataclass(frozen=True)
class HostedWork:
    """Where and how the job host runs a job (single or sweep): the server's settings, the
    spec, the work folder, where its events go, its cancel switch and the host's warm pool."""

    settings: Settings
    spec: JobSpec
    workdir: Path
    report: Callable[[Event], None]
    cancel: threading.Event
    pool: WarmPool | None


def run_job(request: RecalibrationRequest, work: HostedWork, label: JobLabel | None = None) -> JobFiles:
    """Recalibrate, export if asked, and write the model, ``report.json`` and ``report.html``
    into ``workdir`` (``recalibrate_to_files``, as ``bnrecal calibrate`` does): the
    artifacts' files and the report (which names its job, with a ``label``)."""
    settings, spec, workdir, report, cancel, pool = (work.settings, work.spec, work.workdir, work.report,
                                                     work.cancel, work.pool)
    check_cancel(cancel)
    workdir.mkdir(parents=True, exist_ok=True)
    if request.max_retries is None:  # a server job rides out a lost rank by default (docs/api.md)
        request = request.model_copy(update={"max_retries": settings.job_max_retries})
    asked = products_of(spec.outputs)
    paths = {product.name: workdir / product.job_file for product in asked}
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    quantizes = any(product.int8 for product in asked)
    outputs = RunOutputs.named(paths, export_options(spec), int8_options(spec.int8) if quantizes else None)
    run_files = RunFiles(report=workdir / "report.json", report_html=workdir / "report.html", job=label)
    result = recalibrate_to_files(request, settings, outputs, run_files, on_progress=_events(report), cancel=cancel,
                                  pool=pool)
    files = {product.name: _shipped(product, paths[product.name], workdir, cell=False)
             for product in asked if not (product.int8 and result.int8_failed)}  # else the report says why
    for name in ("checkpoint", "program"):  # named by what was uploaded: .pt, .safetensors, .pt2
        if name in spec.outputs:
            model_file = workdir / f"recalibrated{result.loaded.suffix}"
            result.save_model(model_file)
            files[name] = (model_file, OCTET_STREAM)
    files["report"] = (workdir / "report.json", "application/json")
    files["report.html"] = (workdir / "report.html", "text/html; charset=utf-8")
    return JobFiles(files, result.report.to_dict())


def _shipped(product: ExportProduct, path: Path, folder: Path, *, cell: bool) -> tuple[Path, str]:
    """The artifact of an exported file: the file itself, or for OpenVINO's IR the tar of it."""
    download = product.download(cell=cell)
    return (_ir_archive(path, folder / download), TAR) if download is not None else (path, OCTET_STREAM)


def _ir_archive(xml: Path, archive: Path) -> Path:
    """One downloadable file of OpenVINO's two, ``archive``: a tar of ``model.xml`` and
    ``model.bin`` (by those names whatever ``xml`` is called; no times: the same files, the
    same bytes)."""
    import tarfile

    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for part, name in ((xml, "model.xml"), (xml.with_suffix(".bin"), "model.bin")):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = part.stat().st_size, 0o644, 0
            with part.open("rb") as handle:
                tar.addfile(info, handle)
    return archive


def export_options(spec: JobSpec) -> ExportOptions:
    """The spec's ``onnx`` options as the export takes them."""
    return ExportOptions(
        opset=spec.onnx.opset, dtype=spec.onnx.dtype, dynamic_batch=spec.onnx.dynamic_batch,
        input_shape=tuple(spec.onnx.input_shape) if spec.onnx.input_shape is not None else None,
    )


def run_sweep_job(sweep: SweepFiles, work: HostedWork) -> JobFiles:
    """Run a sweep job's cells into ``workdir/<model>/<set>/`` (``sweep_to_files``, as ``bnrecal
    sweep`` does), telling ``report`` of each cell as it finishes, with its files; then the
    matrix report and one zip archive of every file. ``failed`` says how many cells failed."""
    settings, spec, workdir, report, cancel, pool = (work.settings, work.spec, work.workdir, work.report,
                                                     work.cancel, work.pool)
    check_cancel(cancel)
    workdir.mkdir(parents=True, exist_ok=True)
    options = spec.model_copy(update={"max_retries": spec.max_retries if spec.max_retries is not None
                                      else settings.job_max_retries})
    labelled = any(s.eval_data is not None for s in sweep.sets)
    made_by_cells = products_of(spec.outputs)
    int8 = any(product.int8 for product in made_by_cells)
    run = SweepRun(
        options=options, rank_by=sweep_rank_by(spec, labelled),
        outputs=frozenset(product.name for product in made_by_cells),
        int8=int8_options(spec.int8) if int8 else None, export=export_options(spec), cells_at_once=spec.cells_at_once,
    )
    cells: list[str] = []
    archive = _Archive(workdir / "sweep.zip", workdir)

    def on_cell(result: CellResult) -> None:  # its files go into the archive before the server takes them
        key = result.cell.key
        cells.append(key)
        program = sweep.models[result.cell.model_index].program is not None
        artifacts, written = _cell_files(result, spec, program)
        made = {f"{key}/{name}": file for name, file in artifacts.items()}
        archive.add(written)
        report(CellDone(cell_summary(result, workdir), made))

    try:
        matrix = sweep_to_files(sweep, run, settings, workdir, on_cell=on_cell, on_progress=_events(report),
                                cancel=cancel, pool=pool)
        files: dict[str, tuple[Path, str]] = {
            "sweep": (workdir / "sweep.json", JSON), "sweep.csv": (workdir / "sweep.csv", "text/csv; charset=utf-8"),
            "sweep.html": (workdir / "sweep.html", HTML),
        }
        for key in cells:
            page = workdir / key / "report.html"
            if page.is_file():
                files[f"{key}/report.html"] = (page, HTML)
        archive.add(path for path, _ in files.values())
    finally:
        archive.close()
    files["archive"] = (archive.path, "application/zip")
    failed = None
    if matrix.failed:
        named = ", ".join(f"{c.model}/{c.set_name}" for c in matrix.cells if c.status.value == "failed")
        failed = RunError(f"{matrix.failed} of {len(matrix.cells)} cells failed ({named[:300]}); "
                          "the other cells' files are the job's artifacts")
    return JobFiles(files, matrix.to_dict(), failed)


def sweep_rank_by(spec: JobSpec, labelled: bool) -> str:
    """The metric a sweep's matrix ranks by: the spec's, else top-1 after with evaluation data,
    else the worst drift."""
    return check_metric(spec.rank_by or ("after_top1" if labelled else "worst_drift"))


class _Archive:
    """One zip of every file a sweep wrote, laid out as ``bnrecal sweep`` lays them out, filled
    as the cells finish (stored: models and ONNX files do not compress)."""

    def __init__(self, path: Path, root: Path) -> None:
        self.path, self.root = path, root
        self._zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def add(self, files: Iterable[Path]) -> None:
        for file in files:
            self._zip.write(file, file.relative_to(self.root).as_posix())

    def close(self) -> None:
        self._zip.close()


def _cell_files(result: CellResult, spec: JobSpec, program: bool) -> tuple[dict[str, tuple[Path, str]], list[Path]]:
    """A finished cell's artifacts by name (as a single job's), and the files it wrote as
    ``bnrecal sweep`` lays them out (OpenVINO's ``.xml`` and ``.bin``, not their tar)."""
    folder = result.folder
    found: dict[str, tuple[Path, str]] = {}
    if result.report is None:
        return found, []
    found["report"] = (folder / "report.json", JSON)
    written = [folder / "report.json"]
    for product in products_of(spec.outputs):
        path = folder / product.cell_file
        if path.is_file():  # else an INT8 file its guard refused: the cell's report says why
            found[product.name] = _shipped(product, path, folder, cell=True)
            written += [path, path.with_suffix(".bin")] if product.openvino_ir else [path]
    if result.model_file is not None and result.model_file.is_file():
        kind = "program" if program else "checkpoint"
        if kind in spec.outputs:
            found[kind] = (result.model_file, OCTET_STREAM)
            written.append(result.model_file)
    return found, written


def _events(report: Callable[[Event], None]) -> Callable[[int, int | None, str], None]:
    """The run's progress as job events: a phase that counts no samples (exporting,
    quantizing) as (None, None, phase), once."""
    last: list[Event] = []

    def on_progress(done: int, total: int | None, phase: str) -> None:
        event: Event = (done, total, phase) if total is not None else (None, None, phase)
        if not last or last[0] != event:
            last[:] = [event]
            report(event)

    return on_progress

