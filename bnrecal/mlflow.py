"""bnrecal's reports in MLflow, from Python (docs/training.md, "MLflow"): a report as a run, with its
options as params, its figures as metrics and ``report.json``, ``report.html`` and the
files you name as artifacts; ``recalibrate_many``'s cells as a parent run with a child per
cell. Inside an active MLflow run, the run is its child.

    import bnrecal, bnrecal.mlflow
    report = bnrecal.recalibrate(model, loader, options)
    bnrecal.mlflow.log_report(report, options=options, files=["model.onnx"])

Needs MLflow's client (``pip install 'bnrecal[mlflow]'``); ``import bnrecal`` never imports
this. The run goes where MLflow's own calls would: ``MLFLOW_TRACKING_URI`` and
``MLFLOW_EXPERIMENT_NAME``/``MLFLOW_EXPERIMENT_ID``, else MLflow's defaults.
"""

from __future__ import annotations

from bnrecal.service.live.tracking import log_cells, log_report
from bnrecal.service.tracking import report_figures

__all__ = ["log_cells", "log_report", "report_figures"]
