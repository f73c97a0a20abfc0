"""The Python API's reports in MLflow (docs/training.md, "MLflow"; ``bnrecal.mlflow``): a report the
caller holds as a run, ``recalibrate_many``'s cells as a parent run with a child per cell,
each under the caller's active run if there is one (``service.tracking.MlflowRun``)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from os import PathLike
from pathlib import Path
from typing import Any

from bnrecal.service.run.options import RecalibrationOptions
from bnrecal.service.run.report.document import Report, write_report
from bnrecal.service.tracking import MlflowRun, ending

from .many import CellResult


def log_report(report: Report, *, options: RecalibrationOptions | None = None, files: Sequence[str | PathLike[str]] = (),
               name: str = "bnrecal") -> str:
    """Log a report the Python API returned as an MLflow run (a child of the caller's active
    run, if any): ``options`` (else what the report says of the run) as params, its figures
    as metrics, ``report.json``, ``report.html`` and ``files`` as artifacts. Returns the run's
    id. Needs ``bnrecal[mlflow]``; a store it cannot reach is a ``SpecError`` (``mlflow``)."""
    run = MlflowRun.start(name, _report_params(report, options), flag="mlflow")
    with _report_files(report) as written:
        run.finish(report, [*written, *(Path(path) for path in files)])
    return run.run_id


def log_cells(cells: Iterable[CellResult], *, options: RecalibrationOptions | None = None,
              name: str = "bnrecal sweep") -> str:
    """Log ``recalibrate_many``'s cells (as it yields them, or kept) as a parent run with a
    child run per cell (``model <index>/<set>``: its report, or ``FAILED`` with its error),
    each logged as it comes. Returns the parent's id."""
    params = options.model_dump(mode="json") if options is not None else {}
    parent = MlflowRun.start(name, params, flag="mlflow")
    count = succeeded = 0
    with ending(parent):
        for cell in cells:
            count += 1
            child = MlflowRun.start(f"model {cell.model_index}/{cell.set_name}",
                                    {**params, "model_index": cell.model_index, "set": cell.set_name}, parent=parent,
                                    flag="mlflow")
            if cell.report is None:
                child.fail(cell.error or cell.status.value)
                continue
            with _report_files(cell.report) as written:
                child.finish(cell.report, written)
            succeeded += 1
    parent.finish(None, metrics={"cells": float(count), "succeeded": float(succeeded),
                                 "failed": float(count - succeeded)})
    return parent.run_id


def _report_params(report: Report, options: RecalibrationOptions | None) -> dict[str, Any]:
    """A Python run's params: its options, or what its report says of them."""
    if options is not None:
        return options.model_dump(mode="json")
    return {"mode": report.mode, "workers": report.world_size, "batch_size": report.batch_size, "order": report.order,
            "seed": report.seed, "device": report.device, "arch": report.arch}


@contextmanager
def _report_files(report: Report) -> Iterator[list[Path]]:
    """``report.json`` and ``report.html`` written into a temporary folder, for the run's artifacts."""
    from bnrecal.service.run.report.page import write_html_report  # jinja2 and matplotlib: only for the page

    with tempfile.TemporaryDirectory(prefix="bnrecal-mlflow-") as folder:
        written = [Path(folder) / "report.json", Path(folder) / "report.html"]
        write_report(report, written[0])
        write_html_report(report, written[1])
        yield written
