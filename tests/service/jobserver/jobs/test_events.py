"""The Server-Sent Events' data: typed events written as the same compact JSON a client reads
(docs/api.md), and a sweep's cells read defensively from its stored report."""

from __future__ import annotations

from types import SimpleNamespace

from bnrecal.service.jobserver.jobs.events import (
    CellEvent, DeletedEvent, ReadyEvent, cell_events, event_payload, format_event,
)
from bnrecal.service.jobserver.records.views import JobStatus, Progress
from bnrecal.service.jobserver.problems import FieldProblem, Problem


def job(**fields):
    """A job as the events read it."""
    progress = Progress(samples_done=64, samples_total=1797, phase="calibrating")
    values = dict(id="5d0c", status=JobStatus.running, error=None, spec={}, report=None, artifacts={}) | fields
    return SimpleNamespace(progress=lambda: progress, **values)


def test_a_job_event_is_the_compact_json_of_its_state():
    assert format_event(9, "progress", event_payload(job())) == (
        'id: 9\nevent: progress\ndata: {"id":"5d0c","status":"running","progress":'
        '{"samples_done":64,"samples_total":1797,"phase":"calibrating"},"error":null}\n\n'
    )
    error = Problem(type="about:blank", title="Failed", status=500, detail="naïve", node="n1",
                    errors=[FieldProblem(field="data", message="bad")])
    data = format_event(41, "status", event_payload(job(status=JobStatus.failed, error=error))).split("data: ")[1]
    assert data == ('{"id":"5d0c","status":"failed","progress":{"samples_done":64,"samples_total":1797,'
                    '"phase":"calibrating"},"error":{"type":"about:blank","title":"Failed","status":500,'
                    '"detail":"na\\u00efve","node":"n1","errors":[{"field":"data","message":"bad"}]}}\n\n')


def test_a_sweeps_cells_are_read_defensively_and_name_their_artifacts():
    report = {"cells": [
        {"model": "m0", "model_index": 0, "set": "a", "status": "succeeded", "samples": 8},
        {"model": "m1", "model_index": True, "set": 3, "status": "failed", "error": "it broke"},
    ]}
    artifacts = {"m0/a/onnx": None, "m0/a/checkpoint": None, "m0/b/onnx": None, "sweep": None}
    cells = cell_events(job(spec={"models": []}, report=report, artifacts=artifacts))
    assert [format_event(None, "cell", CellEvent(id="5d0c", cell=cell)) for cell in cells] == [
        'event: cell\ndata: {"id":"5d0c","cell":{"model":"m0","model_index":0,"set":"a","status":"succeeded",'
        '"error":null,"artifacts":["m0/a/checkpoint","m0/a/onnx"]}}\n\n',
        'event: cell\ndata: {"id":"5d0c","cell":{"model":"m1","model_index":null,"set":null,"status":"failed",'
        '"error":"it broke","artifacts":[]}}\n\n',
    ]
    assert cell_events(job(report=report)) == []  # a single job has no cells
    assert cell_events(job(spec={"datasets": {}}, report={"cells": "not a list"})) == []


def test_a_tenant_streams_ready_and_deleted_events():
    assert format_event(None, "ready", ReadyEvent(max_streams=8)) == 'event: ready\ndata: {"max_streams":8}\n\n'
    assert format_event(None, "deleted", DeletedEvent(id="5d0c")) == 'event: deleted\ndata: {"id":"5d0c"}\n\n'
