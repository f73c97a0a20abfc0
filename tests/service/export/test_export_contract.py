"""What ``export_folded_onnx`` promises about the file, the report, its options and its
failures: one self-contained file, dynamic batch, full checker, no weights computed at
run time, the caller's model untouched, nothing left behind when it fails."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from bnrecal.service.export import export_folded_onnx
from tests.service.export.helpers import (
    FP16_TOLERANCE,
    assert_matches_torch,
    op_counts,
    run_onnx,
    set_batchnorm_statistics,
)
from bnrecal.errors import ExportError


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return set_batchnorm_statistics(
        nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, groups=8, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5), nn.BatchNorm1d(5),
        )
    )


class CountsCalls(nn.Module):
    """Traces to a constant that differs from its eager output: the export must fail."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.bn(self.conv(x)) * float(self.calls)


def test_single_verified_file_with_dynamic_batch(tmp_path: Path) -> None:
    model, samples = small_cnn(), torch.randn(6, 3, 16, 16)
    out = tmp_path / "model.onnx"
    report = export_folded_onnx(model, samples, out)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # no .onnx.data, no temp file
    proto = onnx.load(str(out), load_external_data=False)
    onnx.checker.check_model(proto, full_check=True)
    assert all(init.data_location == onnx.TensorProto.DEFAULT for init in proto.graph.initializer)
    names = [init.name for init in proto.graph.initializer]
    assert len(names) == len(set(names))
    assert [o.version for o in proto.opset_import if o.domain == ""] == [18]
    batch_dim = proto.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.dim_value
    assert report.to_dict() == {
        "opset": 18, "dtype": "float32", "batch": "dynamic", "batchnorm_nodes": 0, "folded": 3, "unfolded": [],
        "max_abs_diff": report["max_abs_diff"], "max_rel_diff": report["max_rel_diff"],
        "verified_batches": [1, 6], "bytes": out.stat().st_size, "runtimes": report["runtimes"].to_dict(),
    }
    runtimes = report["runtimes"]
    assert runtimes["onnxruntime"]["ran"] and runtimes["onnxruntime"]["max_abs_diff"] == report["max_abs_diff"]
    assert runtimes["openvino"]["ran"] and 0 <= runtimes["openvino"]["max_abs_diff"] <= 1e-4  # the same tolerance
    assert 0 <= report["max_abs_diff"] <= 1e-4 and 0 <= report["max_rel_diff"] <= 1e-4
    for batch in (1, 5):
        assert_matches_torch(out, model, torch.randn(batch, 3, 16, 16))


def test_no_node_computes_weights_at_run_time(tmp_path: Path) -> None:
    """Bias-free convs make the dynamo exporter build zero biases with Shape/Expand; every
    node of the file must read at least one value that is not an initializer."""
    out = tmp_path / "model.onnx"
    export_folded_onnx(small_cnn(), torch.randn(2, 3, 8, 8), out, _torch_fold=False)
    graph = onnx.load(str(out)).graph
    constants = {init.name for init in graph.initializer}
    for node in graph.node:
        assert any(name and name not in constants for name in node.input), node.op_type
        assert node.op_type not in ("Constant", "ConstantOfShape", "Expand", "CastLike")


def test_caller_model_is_not_modified(tmp_path: Path) -> None:
    model = small_cnn().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_folded_onnx(model, torch.randn(2, 3, 8, 8), tmp_path / "m.onnx")
    assert model.training and all(m.training for m in model.modules())
    assert all(isinstance(m, nn.BatchNorm2d) for m in (model[1], model[4]))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_static_batch_and_input_shape(tmp_path: Path) -> None:
    model = small_cnn()
    out = tmp_path / "model.onnx"
    report = export_folded_onnx(model, torch.randn(3, 3, 16, 16), out, dynamic_batch=False, input_shape=(3, 24, 20))
    dims = onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [1, 3, 24, 20]
    assert report["verified_batches"] == [1]
    assert_matches_torch(out, model, torch.randn(1, 3, 24, 20))


@pytest.mark.parametrize("opset", [13, 17, 20, 23])
def test_opset_is_the_users_choice(opset: int, tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    report = export_folded_onnx(small_cnn(), torch.randn(2, 3, 8, 8), out, opset=opset)
    proto = onnx.load(str(out))
    assert report["opset"] == opset and [o.version for o in proto.opset_import if o.domain == ""] == [opset]
    assert op_counts(out)["BatchNormalization"] == 0
    assert_matches_torch(out, small_cnn(), torch.randn(3, 3, 8, 8))


def test_float16_export_is_type_consistent_and_close(tmp_path: Path) -> None:
    """An unfoldable BN (BN -> padded conv) stays, in float16 like everything else."""
    torch.manual_seed(0)
    model = set_batchnorm_statistics(
        nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 6, 3, padding=1), nn.Upsample(scale_factor=2, mode="bilinear"),
                      nn.Conv2d(6, 4, 1, bias=False), nn.BatchNorm2d(4))
    )
    out = tmp_path / "model.onnx"
    report = export_folded_onnx(model, torch.randn(4, 3, 8, 8), out, dtype="float16")
    assert (report["dtype"], report["folded"], report["batchnorm_nodes"]) == ("float16", 1, 1)
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto, full_check=True)
    float16 = onnx.TensorProto.FLOAT16
    assert proto.graph.input[0].type.tensor_type.elem_type == float16
    assert proto.graph.output[0].type.tensor_type.elem_type == float16
    resize_scales = {n.input[2] for n in proto.graph.node if n.op_type == "Resize" and len(n.input) > 2}
    for init in proto.graph.initializer:
        expected = onnx.TensorProto.FLOAT if init.name in resize_scales else float16
        assert init.data_type in (expected, onnx.TensorProto.INT64), init.name
    assert run_onnx(out, torch.randn(2, 3, 8, 8), np.float16)[0].dtype == np.float16
    assert_matches_torch(out, model, torch.randn(3, 3, 8, 8), tolerance=FP16_TOLERANCE, dtype=np.float16)


def test_float16_overflow_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-12)).eval()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[1].running_var.fill_(1e-12)  # scale 1e6: the folded weight overflows float16
    out = tmp_path / "model.onnx"
    with pytest.raises(ExportError, match=r"'0\.weight'.*float16.*BatchNorm '1'"):
        export_folded_onnx(model, torch.randn(2, 3, 8, 8), out, dtype="float16")
    assert list(tmp_path.iterdir()) == []
    export_folded_onnx(model, torch.randn(2, 3, 8, 8), out)  # float32 holds it
    assert out.exists()


def test_failed_verification_fails_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    with pytest.raises(ExportError, match="differs from PyTorch"):
        export_folded_onnx(CountsCalls().eval(), torch.randn(2, 3, 8, 8), out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs,samples,match",
    [
        ({"opset": 9}, torch.randn(2, 3, 8, 8), "opset 9 is not supported"),
        ({"dtype": "bfloat16"}, torch.randn(2, 3, 8, 8), "dtype 'bfloat16'"),
        ({}, torch.randn(1, 3, 8, 8), "at least 2 calibration samples"),
        ({"input_shape": (4, 8, 8)}, torch.randn(2, 3, 8, 8), "4 channels"),
        ({"input_shape": (3, 8)}, torch.randn(2, 3, 8, 8), "does not fit"),
        ({}, torch.randn(2, 5, 8, 8), "fails on the calibration samples"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, samples: torch.Tensor, match: str, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=match):
        export_folded_onnx(small_cnn(), samples, tmp_path / "model.onnx", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_model_that_cannot_be_exported_raises_export_error(tmp_path: Path) -> None:
    """torch.export refuses numpy; the TorchScript trace turns the output into a constant."""

    class NumpyInside(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(np.sort(x.numpy(), axis=1))

    with pytest.raises(ExportError, match="does not depend on the input"):
        export_folded_onnx(NumpyInside(), torch.randn(2, 3), tmp_path / "model.onnx")
    with pytest.raises(ExportError, match="ONNX export failed: .*aten.sort"):  # opset 21: no TorchScript fallback
        export_folded_onnx(NumpyInside(), torch.randn(2, 3), tmp_path / "model.onnx", opset=21)
    assert list(tmp_path.iterdir()) == []


def test_multiple_outputs_are_named_and_verified(tmp_path: Path) -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.relu(self.bn(self.conv(x)))
            return y, self.head(y)

    torch.manual_seed(0)
    model = set_batchnorm_statistics(TwoHeads())
    out = tmp_path / "model.onnx"
    report = export_folded_onnx(model, torch.randn(3, 3, 8, 8), out)
    assert report["folded"] == 1
    assert [o.name for o in onnx.load(str(out)).graph.output] == ["output_0", "output_1"]
    assert_matches_torch(out, model, torch.randn(2, 3, 8, 8))
