"""The Python API's reports in MLflow (service/live/tracking.py, ``bnrecal.mlflow``), in
MLflow's file store, under the caller's own run; a one-worker run in this process."""

from __future__ import annotations

import mlflow  # the mlflow extra is part of the test extra (pyproject.toml)
import pytest
import torch

from tests.nets import mixed_net, no_norm_net, perturbed



def _artifacts(run_id: str) -> list[str]:
    return sorted(item.path for item in mlflow.MlflowClient().list_artifacts(run_id))


def test_the_python_api_logs_under_the_callers_run_and_leaves_it_active(tmp_path, monkeypatch):
    """``bnrecal.mlflow.log_report`` and ``log_cells`` in MLflow's file store: each a child of
    the run the caller has open, which stays the active run; the figures are the report's."""
    import bnrecal
    import bnrecal.mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    torch.manual_seed(0)
    model = perturbed(mixed_net())
    data = torch.randn(16, 3, 6, 5)
    options = bnrecal.RecalibrationOptions(batch_size=8)
    with mlflow.start_run(run_name="training") as training:
        report = bnrecal.recalibrate(model, data, options)
        run_id = bnrecal.mlflow.log_report(report, options=options, name="after swa")
        cells = bnrecal.recalibrate_many([perturbed(mixed_net(), 1), no_norm_net()], data, options)
        parent_id = bnrecal.mlflow.log_cells(cells, options=options)
        assert mlflow.active_run().info.run_id == training.info.run_id
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    assert run.data.tags["mlflow.parentRunId"] == training.info.run_id and run.info.run_name == "after swa"
    assert run.data.params["batch_size"] == "8" and run.data.metrics["samples"] == 16
    assert run.data.metrics == pytest.approx(bnrecal.mlflow.report_figures(report), rel=1e-12)
    assert _artifacts(run_id) == ["report.html", "report.json"]
    children = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'",
                                  order_by=["attributes.run_name ASC"])
    assert [(child.info.run_name, child.info.status) for child in children] == [
        ("model 0/data", "FINISHED"), ("model 1/data", "FAILED")]
    assert client.get_run(parent_id).data.tags["mlflow.parentRunId"] == training.info.run_id
