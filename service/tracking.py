"""Reports in MLflow (docs/training.md, "MLflow"): a job is an MLflow run (its options as params, its
report's figures as metrics, ``report.json``, ``report.html`` and the files written as
artifacts), a sweep a parent run with a child run per cell.

Runs are logged with MLflow's own client (``MlflowClient``) to ``MLFLOW_TRACKING_URI``, else
MLflow's default store, in ``MLFLOW_EXPERIMENT_ID``'s or ``MLFLOW_EXPERIMENT_NAME``'s
experiment (made if missing), else MLflow's default one; inside a run the caller's process
has active, a child of it. MLflow's fluent state (the active run, the tracking URI) is read,
never changed: the Python API is a guest in the caller's process. MLflow is an extra
(``bnrecal[mlflow]``, its client ``mlflow-skinny`` is enough); nothing imports it until a
run is started here.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bnrecal.errors import SpecError, TrackingError, first_line

if TYPE_CHECKING:
    from bnrecal.service.run.report.document import Report
    from bnrecal.service.sweep.matrix import SweepReport

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag: its UI nests a child run under it
ERROR_TAG = "bnrecal.error"
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param's value (MLflow 2 and 3)


def report_figures(report: Report) -> dict[str, float]:
    """The report's figures, by name, as metrics: what ran (samples, steps, seconds), how far
    the statistics moved, and with evaluation, ONNX or INT8 what those measured. The same
    names in MLflow and in the Lightning callback's logger (under ``bnrecal/``)."""
    layers = report.layers
    shifts = [layer.mean_shift for layer in layers if layer.mean_shift is not None]
    ratios_max = [layer.var_ratio_max for layer in layers if layer.var_ratio_max is not None]
    ratios_min = [layer.var_ratio_min for layer in layers if layer.var_ratio_min is not None]
    figures: dict[str, Any] = {
        "samples": report.samples,
        "steps": report.steps,
        "seconds": report.seconds,
        "samples_per_second": report.samples_per_second,
        "world_size": report.world_size,
        "collectives": report.collectives,
        "attempts": report.attempts,
        "bn_layers": len(layers),
        "skipped_layers": len(report.skipped),
        "mean_shift_max": max(shifts, default=None),
        "var_ratio_max": max(ratios_max, default=None),
        "var_ratio_min": min(ratios_min, default=None),
    }
    if report.standard_error_max is not None:
        figures["standard_error_max"] = report.standard_error_max.error
    if report.convergence is not None:
        figures["converged"] = report.convergence.converged
    evaluation = report.evaluation
    if evaluation is not None:
        figures["prediction_change"] = evaluation.prediction_change
        figures["kl_divergence"] = evaluation.kl_divergence
        for when, scores in (("before", evaluation.before), ("after", evaluation.after)):
            if scores is not None:
                figures.update({f"top1_{when}": scores.top1, f"top5_{when}": scores.top5,
                                f"cross_entropy_{when}": scores.cross_entropy})
    if report.onnx is not None:
        figures.update({"onnx_max_abs_diff": report.onnx.max_abs_diff, "onnx_bytes": report.onnx.bytes,
                        "onnx_batchnorm_nodes": report.onnx.batchnorm_nodes})
    int8 = report.int8
    if int8 is not None:
        figures.update({"int8_written": int8.written, "int8_bytes": int8.bytes, "int8_fp32_bytes": int8.fp32_bytes,
                        "int8_max_abs_diff": int8.max_abs_diff})
        if int8.evaluation is not None:
            figures.update({"int8_top1": int8.evaluation.int8.top1, "int8_fp32_top1": int8.evaluation.fp32.top1,
                            "int8_top1_drop_points": int8.evaluation.top1_drop_points})
        if int8.latency_ms is not None:
            figures.update({"int8_latency_ms": int8.latency_ms.int8, "int8_fp32_latency_ms": int8.latency_ms.fp32})
    gate = report.get("gate")  # the Lightning callback's section (service.live.lightning)
    if gate is not None:
        figures.update({"gate_top1_before": gate.before, "gate_top1_after": gate.after, "gate_kept": gate.kept})
    return {name: float(value) for name, value in figures.items() if value is not None and math.isfinite(float(value))}


def param_values(params: Mapping[str, Any]) -> dict[str, str]:
    """Params as MLflow keeps them (strings): JSON for objects and lists, None left out; a
    value past MLflow's limit is refused rather than cut (a param must say what ran)."""
    values = {}
    for name, value in params.items():
        if value is None:
            continue
        text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list, tuple)) else str(value)
        if len(text) > MAX_PARAM_LENGTH:
            raise SpecError(f"--mlflow: param {name} is {len(text)} characters, past MLflow's {MAX_PARAM_LENGTH}",
                            field="--mlflow")
        values[name] = text
    return values


@dataclass
class MlflowRun:
    """One MLflow run bnrecal logs to. It is made before the work starts, so that a store
    that cannot be written is refused before any worker starts and a job that fails leaves
    a run that says so (``FAILED``, the error as the ``bnrecal.error`` tag)."""

    client: Any
    run_id: str
    experiment_id: str

    @classmethod
    def start(cls, name: str, params: Mapping[str, Any], *, parent: MlflowRun | None = None,
              flag: str = "--mlflow") -> MlflowRun:
        """Make the run ``name`` with ``params``: under ``parent`` (a sweep's cell), else
        under the caller's active MLflow run if there is one, else at the top of the
        experiment. A missing MLflow or a store it cannot reach is a ``SpecError`` naming
        ``flag``."""
        try:
            import mlflow
            from mlflow import MlflowClient
        except ImportError:
            raise SpecError(f"{flag} needs MLflow's client: pip install 'bnrecal[mlflow]'", field=flag) from None
        values = param_values(params)
        client = MlflowClient()
        try:
            active = mlflow.active_run() if parent is None else None
            parent_id = parent.run_id if parent is not None else active.info.run_id if active is not None else None
            if parent is not None:
                experiment_id = parent.experiment_id
            elif active is not None:
                experiment_id = active.info.experiment_id
            else:
                experiment_id = _experiment_id(client)
            tags = {PARENT_TAG: parent_id} if parent_id is not None else {}
            run = client.create_run(experiment_id, run_name=name, tags=tags)
            from mlflow.entities import Param

            client.log_batch(run.info.run_id, params=[Param(key, value) for key, value in values.items()])
        except Exception as exc:  # noqa: BLE001 - MLflow raises its own, requests' and the store's errors
            raise SpecError(f"{flag}: cannot log to MLflow at {mlflow.get_tracking_uri()}: {first_line(exc)}",
                            field=flag) from None
        return cls(client, run.info.run_id, experiment_id)

    def finish(self, report: Report | None, files: Sequence[Path | None] = (),
               metrics: Mapping[str, float] | None = None) -> None:
        """Log the report's figures (and ``metrics``) and every file in ``files`` that exists
        (a folder: its files, under its name), then end the run ``FINISHED``."""
        from mlflow.entities import Metric

        figures = report_figures(report) if report is not None else {}
        figures.update(metrics or {})
        stamp = _now_ms()
        try:
            self.client.log_batch(self.run_id, metrics=[Metric(key, value, stamp, 0) for key, value in figures.items()])
            for path in files:
                if path is None or not Path(path).exists():
                    continue
                if Path(path).is_dir():
                    self.client.log_artifacts(self.run_id, str(path), artifact_path=Path(path).name)
                else:
                    self.client.log_artifact(self.run_id, str(path))
            self.client.set_terminated(self.run_id, "FINISHED")
        except Exception as exc:  # noqa: BLE001 - MLflow raises its own, requests' and the store's errors
            self.fail(exc)
            raise TrackingError(f"the files are written, but MLflow run {self.run_id} could not be logged: "
                                f"{first_line(exc)}") from None

    def fail(self, error: BaseException | str) -> None:
        """End the run ``FAILED`` (``KILLED`` when the user interrupted it), saying why. Never
        raises: the job's own error is what the caller reports."""
        status = "KILLED" if isinstance(error, (KeyboardInterrupt, SystemExit)) else "FAILED"  # Ctrl-C, or an exit on it
        try:
            self.client.set_tag(self.run_id, ERROR_TAG, (str(error) or type(error).__name__)[:5000])
            self.client.set_terminated(self.run_id, status)
        except Exception:  # noqa: BLE001 - the store went away meanwhile: the job's error stands
            pass


def log_sweep(parent: MlflowRun, report: SweepReport, out_dir: Path, params: Mapping[str, Any]) -> None:
    """Log a sweep that ran: a child run of ``parent`` per cell (its model and set as params
    besides ``params``, its report's figures, its folder's files), then ``parent`` with the
    matrix's counts and ``sweep.json``, ``sweep.csv``, ``sweep.html``."""
    from bnrecal.service.run.report.document import Report
    from bnrecal.service.sweep.cells import CellStatus

    try:
        for cell in report.cells:
            child = MlflowRun.start(f"{cell.model}/{cell.set_name}",
                                    {**params, "model": cell.model, "set": cell.set_name}, parent=parent)
            folder = out_dir / cell.model / cell.set_name
            if cell.status is not CellStatus.SUCCEEDED:
                child.fail(cell.error or cell.status.value)
                continue
            cell_report = Report.model_validate_json((folder / "report.json").read_text())
            child.finish(cell_report, sorted(folder.iterdir()) if folder.is_dir() else [])
    except SpecError as exc:  # the store went away after the sweep ran: its files stand
        parent.fail(exc)
        raise TrackingError(f"the files are written, but MLflow run {parent.run_id} could not be logged: "
                            f"{exc.message}") from None
    counts = {"cells": len(report.cells), "succeeded": report.succeeded, "failed": report.failed,
              "cancelled": report.cancelled, "seconds": report.seconds}
    parent.finish(None, [out_dir / name for name in ("sweep.json", "sweep.csv", "sweep.html")],
                  metrics={name: float(value) for name, value in counts.items()})


@contextmanager
def ending(run: MlflowRun | None) -> Iterator[None]:
    """Around the work a run waits for: when it fails or is interrupted, the run (if any)
    ends ``FAILED`` (``KILLED``), saying why, and the error goes on to the caller."""
    try:
        yield
    except BaseException as exc:
        if run is not None:
            run.fail(exc)
        raise


def _experiment_id(client: Any) -> str:
    """The experiment MLflow's own fluent API would log to: ``MLFLOW_EXPERIMENT_ID``, else
    ``MLFLOW_EXPERIMENT_NAME``'s (made if missing), else the default one."""
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if name:
        experiment = client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else client.create_experiment(name)
    from mlflow.tracking.default_experiment import DEFAULT_EXPERIMENT_ID

    return DEFAULT_EXPERIMENT_ID


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)
