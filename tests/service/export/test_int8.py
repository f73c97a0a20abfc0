"""INT8 export in one process (the world of one): onnxruntime's own tooling gives the same
file, the checks hold on real zoo models, the options and the accuracy guard behave."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torchvision

from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.errors import ExportError, SpecError
from bnrecal.workers.ranks.ort.rank_pass import OnnxPassRequest, PassModel, onnx_pass

from bnrecal.service.export.int8.checks import LabelledBatches
from bnrecal.errors import Int8GuardError
from bnrecal.service.export.int8.options import Int8Options, int8_options
from bnrecal.service.export.int8.quantizer import prepare, ranges_as_minmax, tensors_data, write_qdq
from bnrecal.service.run.outputs.int8 import quantize_export, range_request
from bnrecal.service.run.outputs.onnx_passes import InProcessPasses, OnnxPasses
from tests.service.export.int8_helpers import (
    OutlierNet,
    array_dataset,
    fp32_export,
    ort_calibrator_ranges,
    ort_quantize_static,
)

BATCH = 16


@pytest.fixture(scope="module")
def resnet(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, torch.Tensor]:
    """A torchvision resnet18 at 32x32 and 48 samples (three full batches)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    samples = torch.randn(48, 3, 32, 32)
    return fp32_export(model, samples, tmp_path_factory.mktemp("resnet") / "fp32.onnx"), samples


def ranges_here(prepared, samples: torch.Tensor, options: Int8Options) -> SimpleNamespace:
    """One range pass in this process: the model's ranges (histograms, edges) and the collectives made."""
    request = OnnxPassRequest((PassModel(prepared.model, range_request(prepared, options)),))
    ranges = [(i, min(i + BATCH, len(samples))) for i in range(0, len(samples), BATCH)]
    batches = lambda: (samples[a:b] for a, b in ranges)  # noqa: E731
    result = onnx_pass(request, ranges, batches, SingleProcessCollective(), 0)
    found = result.models[0]
    return SimpleNamespace(ranges=found.ranges, histograms=found.histograms, edges=found.edges,
                           collectives=result.collectives)


class ResidualNet(torch.nn.Module):
    """A small residual net: a stem and one basic block (an Add of the block and the stem),
    10 tensors to calibrate where resnet18 has 50."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU())
        self.block = torch.nn.Sequential(
            torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
        )
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.head(torch.relu(self.block(x) + x).mean((2, 3)))


@pytest.fixture(scope="module")
def entropy_here(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A small residual net at 16x16 and 48 samples (three full batches) prepared, its entropy
    ranges gathered here (2048 bins) and their thresholds: computed once, for the tests that
    compare them with onnxruntime's calibrator and its file. onnxruntime's entropy search
    takes about a second a tensor whatever the tensor's size (a Python loop over the 2048
    bins), here and in its calibrator: the net has the resnet's kinds of tensors (Conv,
    Relu, a residual Add, the pooled mean, Gemm) but 10 of them, not resnet18's 50."""
    torch.manual_seed(2)
    samples = torch.randn(48, 3, 16, 16)
    fp32 = fp32_export(ResidualNet(), samples, tmp_path_factory.mktemp("residual") / "fp32.onnx")
    prepared = prepare(fp32)
    options = Int8Options(method="entropy")
    gathered = ranges_here(prepared, samples, options)
    return SimpleNamespace(samples=samples, prepared=prepared, options=options, gathered=gathered,
                           data=tensors_data(gathered.ranges, gathered.histograms, gathered.edges, options))


def top1(model: bytes, data: LabelledBatches) -> float:
    """The model's top-1 on held batches, counted plainly in onnxruntime."""
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    right = sum(int((session.run(None, {name: x})[0].argmax(1) == y).sum()) for x, y in zip(data.batches, data.labels))
    return right / data.samples


@pytest.mark.parametrize("asked, reduce_range", [({}, True), ({"reduce_range": False}, False)])
def test_minmax_file_is_byte_for_byte_what_quantize_static_writes(resnet, tmp_path, asked, reduce_range):
    """The default file is ``quantize_static``'s with 7-bit weights (``reduce_range``, which
    no x86 CPU's 8-bit kernels can saturate); ``reduce_range: false`` is its full 8-bit file."""
    fp32, samples = resnet
    prepared = prepare(fp32)
    options = Int8Options(**asked)
    gathered = ranges_here(prepared, samples, options)
    ours = write_qdq(prepared, tensors_data(gathered.ranges, None, None, options), options, [])
    assert ours == ort_quantize_static(prepared.model, samples, BATCH, "minmax", tmp_path, reduce_range=reduce_range)
    assert gathered.collectives == 1


@pytest.mark.parametrize("method", ["percentile", "entropy"])
def test_histogram_ranges_agree_with_onnxruntime_within_a_bin(resnet, entropy_here, tmp_path, method):
    if method == "entropy":
        samples, prepared, options, gathered, ours = (entropy_here.samples, entropy_here.prepared, entropy_here.options,
                                                      entropy_here.gathered, entropy_here.data)
    else:
        fp32, samples = resnet
        prepared = prepare(fp32)
        options = Int8Options(method=method)
        gathered = ranges_here(prepared, samples, options)
        ours = tensors_data(gathered.ranges, gathered.histograms, gathered.edges, options)
    theirs, their_edges = ort_calibrator_ranges(prepared.model, samples, BATCH, method, tmp_path,
                                                num_bins=options.histogram_bins())
    assert set(ours.keys()) == set(theirs.keys()) == set(prepared.tensors)
    assert gathered.collectives == 2  # min/max, then the histograms
    for index, name in enumerate(prepared.tensors):
        bin_width = max(float(np.diff(gathered.edges[index][:2])[0]), float(np.diff(their_edges[name][:2])[0]))
        for a, b in zip(ours[name].range_value, theirs[name].range_value):
            assert abs(float(a) - float(b)) <= bin_width * 1.001, (name, a, b, bin_width)


def test_entropy_default_file_is_not_the_minmax_file_and_is_onnxruntimes_at_the_same_bins(entropy_here, tmp_path):
    """At onnxruntime's old default (128 bins) entropy's only candidate threshold is the whole
    range, and it wrote the minmax file; at 2048 bins (the default now) it does not, and with
    every sample in one batch (onnxruntime's histogram then spans the global range, as ours
    does) its ranges are onnxruntime's entropy calibrator's exactly, so the file is too."""
    samples, prepared, entropy_options, gathered, ours = (entropy_here.samples, entropy_here.prepared,
                                                          entropy_here.options, entropy_here.gathered, entropy_here.data)
    minmax_options = Int8Options()
    assert entropy_options.histogram_bins() == 2048 and entropy_options.quantized_bins == 128
    minmax = ranges_here(prepared, samples, minmax_options)
    minmax_file = write_qdq(prepared, tensors_data(minmax.ranges, None, None, minmax_options), minmax_options, [])
    entropy_file = write_qdq(prepared, ours, entropy_options, [])
    assert entropy_file != minmax_file
    theirs, _ = ort_calibrator_ranges(prepared.model, samples, len(samples), "entropy", tmp_path, num_bins=2048)
    assert write_qdq(prepared, theirs, entropy_options, []) == entropy_file
    assert ranges_as_minmax(ours, gathered.ranges)["tensors"] < len(prepared.tensors)
    old = Int8Options(method="entropy", bins=128)
    same = ranges_here(prepared, samples, old)
    as_minmax = ranges_as_minmax(tensors_data(same.ranges, same.histograms, same.edges, old), same.ranges)
    assert as_minmax["tensors"] == as_minmax["of"] and "minmax file" in as_minmax["note"]


@pytest.mark.parametrize("arch", ["mobilenet_v2", "timm:resnet10t"])
def test_zoo_models_quantize_checker_clean_and_run(arch, tmp_path):
    torch.manual_seed(1)
    if arch.startswith("timm:"):
        timm = pytest.importorskip("timm")
        model = timm.create_model(arch.split(":")[1], pretrained=False, num_classes=7)
    else:
        model = torchvision.models.get_model(arch, weights=None, num_classes=7)
    samples = torch.randn(24, 3, 32, 32)
    fp32 = fp32_export(model, samples, tmp_path / "fp32.onnx")
    quantized = quantize_export(fp32, Int8Options(), InProcessPasses(array_dataset(tmp_path / "x.npy", samples), 8), samples)
    onnx.checker.check_model(onnx.load_from_string(quantized.model), full_check=True)
    section = quantized.section
    assert section["ops_quantized"]["Conv"] >= 10
    assert section["collectives"] == [1] and section["samples"] == 24
    assert len(quantized.model) < 0.4 * len(fp32)
    assert np.isfinite(section["max_abs_diff"]) and section["max_abs_diff"] < 0.5 * max(1.0, section["fp32_max_abs"])


def test_keep_float_by_op_type_leaves_those_ops_float_with_the_reason(resnet, tmp_path):
    fp32, samples = resnet
    dataset = array_dataset(tmp_path / "x.npy", samples)
    section = quantize_export(fp32, Int8Options(keep_float=["Gemm"]), InProcessPasses(dataset, BATCH), samples).section
    assert "Gemm" not in section["ops_quantized"]
    gemm = [op for op in section["ops_float"] if op["op_type"] == "Gemm"]
    assert len(gemm) == 1 and "int8.keep_float" in gemm[0]["reason"]
    with pytest.raises(ExportError, match="int8.keep_float: 'NoSuchOp'"):
        quantize_export(fp32, Int8Options(keep_float=["NoSuchOp"]), InProcessPasses(dataset, BATCH), samples)


@pytest.mark.parametrize(
    ("value", "field"),
    [({"method": "kl"}, "int8.method"), ({"per_channel": "yes"}, "int8.per_channel"),
     ({"max_top1_drop": -1}, "int8.max_top1_drop"), ({"max_top1_drop": "1"}, "int8.max_top1_drop"), ({"bins": 3}, "int8.bins"), ({"typo": 1}, "int8.typo"),
     ({"activation_type": "int4"}, "int8.activation_type")],
)
def test_bad_options_are_refused_naming_the_field(value, field):
    with pytest.raises(SpecError) as caught:
        int8_options(value)
    assert caught.value.field == field and str(caught.value).startswith(field)


@pytest.fixture(scope="module")
def outlier(tmp_path_factory: pytest.TempPathFactory):
    """The outlier net, its FP32 export, calibration data and evaluation data labelled by the
    FP32 model itself (so FP32 top-1 is 1 and every INT8 miss is quantization's)."""
    torch.manual_seed(3)
    tmp = tmp_path_factory.mktemp("outlier")
    model = OutlierNet().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_(0, 0.1)
    samples = torch.randn(64, 3, 8, 8)
    evaluation = torch.randn(256, 3, 8, 8)
    with torch.no_grad():
        labels = model(evaluation).argmax(dim=1).numpy()
    fp32 = fp32_export(model, samples, tmp / "fp32.onnx")
    data = LabelledBatches([evaluation[i : i + 64].numpy() for i in range(0, 256, 64)],
                           [labels[i : i + 64] for i in range(0, 256, 64)])
    return fp32, samples, array_dataset(tmp / "x.npy", samples), data


def test_guard_keeps_the_measured_most_sensitive_ops_float_until_the_bound_holds(outlier):
    fp32, samples, dataset, data = outlier
    passes = InProcessPasses(dataset, 32, evaluation=data)
    plain = quantize_export(fp32, Int8Options(), passes, samples).section
    assert top1(fp32, data) == 1.0
    assert plain["evaluation"]["top1_drop_points"] > 5  # the outlier channel costs real accuracy
    guarded = quantize_export(fp32, Int8Options(max_top1_drop=1.0, max_float_ops=2), passes, samples).section
    guard = guarded["guard"]
    kept = guard["kept_float"]
    assert kept and guard["held"] and guarded["written"]
    assert all("top1_gain_alone_points" in op and "selection_top1_after" in op for op in kept)
    assert all(op["top1_gain_alone_points"] > 1 for op in kept[:1])  # points, like max_top1_drop
    listed = {op["name"]: op["reason"] for op in guarded["ops_float"]}
    assert all("max_top1_drop" in listed[op["name"]] for op in kept)
    # the accuracies are reported on the samples the choice never saw
    assert guarded["evaluation"]["samples"] == guard["report"]["samples"] == 128
    assert guard["selection"]["samples"] == 128 and guard["report_drop_points"] == guarded["evaluation"]["top1_drop_points"]
    assert guard["held_on_report"] == (guard["report_drop_points"] <= 1.0)


def test_guard_that_cannot_hold_fails_saying_so_with_the_section(outlier):
    fp32, samples, dataset, data = outlier
    with pytest.raises(Int8GuardError, match=r"max_top1_drop 0\.5.*no INT8 file written") as caught:
        quantize_export(fp32, Int8Options(max_top1_drop=0.5, max_float_ops=0),
                        InProcessPasses(dataset, 32, evaluation=data), samples)
    section = caught.value.section
    assert section["written"] is False and "max_top1_drop" in section["failure"]
    assert section["guard"]["held"] is False and section["evaluation"]["samples"] == 128


def test_keep_float_and_op_types_are_checked_before_any_range_pass(resnet):
    fp32, samples = resnet

    class NoPasses(OnnxPasses):
        def _run(self, request, over):
            raise AssertionError("a pass ran before the names were checked")

    no_range_pass = NoPasses(None, 0, None)

    with pytest.raises(ExportError, match="int8.keep_float: 'Conv_typo'"):
        quantize_export(fp32, Int8Options(keep_float=["Conv_typo"]), no_range_pass, samples)
    with pytest.raises(ExportError, match="int8.op_types: 'Cnov'"):
        quantize_export(fp32, Int8Options(op_types=["Cnov"]), no_range_pass, samples)


def test_file_does_not_depend_on_the_batches_it_was_gathered_in(resnet, tmp_path):
    """The same samples in other batch splits (what K ranks see) give the same bytes."""
    fp32, samples = resnet
    dataset = array_dataset(tmp_path / "x.npy", samples)
    files = {batch: quantize_export(fp32, Int8Options(), InProcessPasses(dataset, batch), samples).model
             for batch in (5, 16, 48)}
    assert len(set(files.values())) == 1
