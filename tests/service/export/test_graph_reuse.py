"""One exporter trace for models of one structure (``service/export/graph_reuse.py``): the
stale model's export made from the recalibrated model's traced graph with its own weights is
byte for byte the file a trace of its own writes; a model of another structure is traced
anew; a trace made ahead on a thread from one sample (``TraceAhead``, ``trace_ahead``) serves
the export of the model once recalibrated, and one that fails leaves the export to trace."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision

import bnrecal.service.export.folded_onnx as folded_onnx
from bnrecal.service.export import export_folded_onnx, trace_ahead
from bnrecal.service.export.graph_reuse import GraphReuse, TraceAhead


@pytest.fixture
def traces(monkeypatch) -> list[str]:
    """Each exporter trace, counted (the real exporter runs)."""
    calls: list[str] = []
    real = folded_onnx.export_unfolded

    def counted(*args, **kwargs):
        calls.append("trace")
        return real(*args, **kwargs)

    monkeypatch.setattr(folded_onnx, "export_unfolded", counted)
    return calls


def with_other_statistics(model: torch.nn.Module) -> torch.nn.Module:
    """The model with other BN running statistics (a stale checkpoint of it)."""
    stale = copy.deepcopy(model)
    for module in stale.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return stale


def test_the_stale_models_export_from_the_traced_graph_is_the_file_of_its_own_trace(tmp_path, traces):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    stale = with_other_statistics(model)
    samples = torch.randn(8, 3, 32, 32)
    reuse = GraphReuse()
    export_folded_onnx(model, samples, tmp_path / "model.onnx", reuse=reuse)
    assert reuse.traced is not None and len(traces) == 1
    section = export_folded_onnx(stale, samples, tmp_path / "reused.onnx", reuse=reuse, openvino=False)
    assert len(traces) == 1  # no trace of its own
    export_folded_onnx(stale, samples, tmp_path / "traced.onnx", openvino=False)
    assert (tmp_path / "reused.onnx").read_bytes() == (tmp_path / "traced.onnx").read_bytes()
    assert (tmp_path / "reused.onnx").read_bytes() != (tmp_path / "model.onnx").read_bytes()
    assert section["runtimes"]["openvino"]["ran"] is False and section["max_abs_diff"] < 1e-4


def test_a_model_of_another_structure_is_traced_anew(tmp_path, traces):
    torch.manual_seed(1)
    first = torchvision.models.resnet18(num_classes=10).eval()
    other = torchvision.models.resnet18(num_classes=7).eval()  # another head: other shapes
    samples = torch.randn(8, 3, 32, 32)
    reuse = GraphReuse()
    export_folded_onnx(first, samples, tmp_path / "first.onnx", reuse=reuse, openvino=False)
    export_folded_onnx(other, samples, tmp_path / "other.onnx", reuse=reuse, openvino=False)
    assert len(traces) == 2  # its weights do not fit the traced graph
    export_folded_onnx(other, samples, tmp_path / "alone.onnx", openvino=False)
    assert (tmp_path / "other.onnx").read_bytes() == (tmp_path / "alone.onnx").read_bytes()


def test_a_trace_made_ahead_from_one_sample_serves_the_recalibrated_models_export(tmp_path, traces):
    torch.manual_seed(2)
    stale = torchvision.models.resnet18(num_classes=10).eval()
    recalibrated = with_other_statistics(stale)  # the statistics came in after the trace
    samples = torch.randn(8, 3, 32, 32)
    ahead = trace_ahead(stale, samples[:1].expand(2, 3, 32, 32).clone())
    ahead.start()
    traced = ahead.result()
    assert traced is not None and len(traces) == 1
    export_folded_onnx(recalibrated, samples, tmp_path / "reused.onnx", reuse=GraphReuse(traced), openvino=False)
    assert len(traces) == 1  # no trace of its own
    export_folded_onnx(recalibrated, samples, tmp_path / "traced.onnx", openvino=False)
    assert (tmp_path / "reused.onnx").read_bytes() == (tmp_path / "traced.onnx").read_bytes()


def test_a_trace_ahead_that_fails_or_never_started_leaves_the_export_to_trace():
    def fails():
        raise RuntimeError("the exporter cannot trace this model")

    ahead = TraceAhead(fails)
    assert ahead.result() is None  # never started: nothing to wait for
    ahead.start()
    assert ahead.result() is None
