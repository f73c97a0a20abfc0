"""The report's JSON keeps every field: reports of runs that fill every section (ONNX and
INT8 with the guard, evaluation in both runtimes, convergence, a program, a server job's
label, the Python API's model and data) are written now and compared, field by field and
type by type, with the same runs' reports written by the code before the report became
typed models (``report_shape_before.json``, made once with ``BNRECAL_WRITE_REPORT_SHAPE=1``
on that code).

A field that disappears, is renamed or changes its JSON type fails here."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.run.options import ExportOptions
from bnrecal.service.run.outputs.later_phases import RunOutputs
from bnrecal.service.run.recalibrate import RunFiles, recalibrate_to_files
from bnrecal.service.run.request import RecalibrationRequest
from bnrecal.service.run.report.page import JobLabel
from bnrecal.service.settings import Settings
from tests.conftest import save_array, save_state
from tests.nets import classifier_net, perturbed

BEFORE = Path(__file__).with_name("report_shape_before.json")


def shape(value: Any, path: str = "") -> dict[str, str]:
    """Every key path of a JSON value with its JSON type (lists by their items, merged)."""
    if isinstance(value, dict):
        found = {path or ".": "object"}
        for key, item in value.items():
            if path.endswith(".hosts") or path.endswith(".inputs") or path.endswith("ops_quantized"):
                key = "*"  # keyed by node id, spec field or op type: the keys are data
            found.update(shape(item, f"{path}.{key}"))
        return found
    if isinstance(value, list):
        found = {path: "array"}
        for item in value:
            found.update(shape(item, f"{path}[]"))
        return found
    kind = {bool: "boolean", int: "number", float: "number", str: "string", type(None): "null"}[type(value)]
    return {path: kind}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shape")
    torch.manual_seed(5)
    model = perturbed(classifier_net(6))
    calibration = torch.randn(40, 3, 8, 8) * 1.5 + 0.3
    evaluation = torch.randn(30, 3, 8, 8) * 1.5 + 0.3
    np.savez(root / "eval.npz", x=evaluation.numpy(), y=np.arange(30) % 6)
    return {
        "root": root,
        "checkpoint": save_state(root / "m.pt", model),
        "data": save_array(root / "x.npy", calibration.numpy()),
        "eval": root / "eval.npz",
    }


def _request(inputs: dict[str, Path], **values: Any) -> RecalibrationRequest:
    return RecalibrationRequest(
        arch="tests.nets:classifier_net", checkpoint=inputs["checkpoint"], data=inputs["data"], workers=1,
        batch_size=16, model_kwargs={"classes": 6}, **values,
    )


def _report(inputs: dict[str, Path], name: str, request: RecalibrationRequest, outputs: RunOutputs,
            job: JobLabel | None = None) -> dict[str, Any]:
    path = inputs["root"] / f"{name}.json"
    settings = Settings(model_modules=["tests"], data_dir=inputs["root"] / "state")
    recalibrate_to_files(request, settings, outputs, RunFiles(report=path, job=job), in_process=True)
    return json.loads(path.read_text())


CASES = ("int8_guarded", "onnx_pytorch_evaluation_convergence", "job", "python_api")


def report_of(case: str, inputs: dict[str, Path]) -> dict[str, Any]:
    """The report of one case's run: every optional section filled by some case."""
    root = inputs["root"]
    if case == "int8_guarded":
        options = Int8Options(method="percentile", max_top1_drop=100.0, op_types=["Conv", "Gemm"])
        outputs = RunOutputs(int8=root / "q.onnx", int8_options=options, export=ExportOptions())
        return _report(inputs, case, _request(inputs, eval_data=inputs["eval"]), outputs)
    if case == "onnx_pytorch_evaluation_convergence":
        outputs = RunOutputs(onnx=root / "m.onnx", export=ExportOptions())
        request = _request(inputs, eval_data=inputs["eval"], max_samples="auto")
        return _report(inputs, case, request, outputs)
    if case == "python_api":
        import bnrecal

        torch.manual_seed(0)
        report = bnrecal.recalibrate(perturbed(classifier_net(6)), torch.randn(24, 3, 8, 8), workers=1, batch_size=8)
        report.save(root / "live.json")
        return json.loads((root / "live.json").read_text())
    label = JobLabel("job-1", datetime(2026, 1, 2, tzinfo=UTC), {"data": {"filename": "x.npy", "digest": "sha256:0"}})
    return _report(inputs, case, _request(inputs), RunOutputs(export=ExportOptions()), job=label)


@pytest.mark.parametrize("case", CASES)
def test_the_report_keeps_every_field_and_type(case, inputs):
    now = shape(report_of(case, inputs))
    if os.environ.get("BNRECAL_WRITE_REPORT_SHAPE"):
        before = json.loads(BEFORE.read_text()) if BEFORE.exists() else {}
        before[case] = now
        BEFORE.write_text(json.dumps(before, indent=1, sort_keys=True) + "\n")
    before = json.loads(BEFORE.read_text())[case]
    lost = {path: kind for path, kind in before.items() if path not in now}
    changed = {path: (kind, now[path]) for path, kind in before.items() if path in now and now[path] != kind
               and "null" not in (kind, now[path])}
    assert lost == {} and changed == {}, f"fields lost: {lost}; types changed: {changed}"
