"""Small models and data for the INT8 tests, and onnxruntime's own single-process tooling
to compare with."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bnrecal.workers.data import DatasetSpec, describe_dataset

from bnrecal.service.export import export_folded_onnx


def fp32_export(model: nn.Module, samples: torch.Tensor, path: Path) -> bytes:
    """The folded, verified FP32 export's bytes."""
    export_folded_onnx(model.eval(), samples[:8], path)
    return path.read_bytes()


def array_dataset(path: Path, samples: torch.Tensor) -> DatasetSpec:
    """``samples`` saved as .npy and described as calibration data (in the given order)."""
    np.save(path, samples.numpy())
    return describe_dataset(path)


def batch_reader(samples: torch.Tensor, batch: int):
    """onnxruntime's calibration data reader over ``samples`` in batches of ``batch``."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"input": samples[i : i + batch].numpy()} for i in range(0, len(samples), batch)])

        def get_next(self) -> dict | None:
            return next(self.batches, None)

    return Reader()


def ort_quantize_static(prepared: bytes, samples: torch.Tensor, batch: int, method: str, tmp: Path, *,
                        reduce_range: bool) -> bytes:
    """onnxruntime's own single-process ``quantize_static`` (QDQ, per-channel int8 weights,
    7-bit with ``reduce_range``, uint8 activations) over ``samples`` in batches of ``batch``."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    source, target = tmp / "prepared.onnx", tmp / "ort-int8.onnx"
    source.write_bytes(prepared)

    methods = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
               "entropy": CalibrationMethod.Entropy}
    with contextlib.redirect_stdout(io.StringIO()):
        quantize_static(
            str(source), str(target), batch_reader(samples, batch), quant_format=QuantFormat.QDQ, per_channel=True,
            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, calibrate_method=methods[method],
            reduce_range=reduce_range,
        )
    return without_unused_domains(target.read_bytes())


def without_unused_domains(model: bytes) -> bytes:
    """``model`` with the opset imports no node uses removed, as bnrecal writes its files
    (onnxruntime's pre-processing declares eight that a QDQ file never uses)."""
    import onnx

    proto = onnx.load_from_string(model)
    used = {node.domain for node in proto.graph.node} | {"", "ai.onnx"}
    keep = [opset for opset in proto.opset_import if opset.domain in used]
    del proto.opset_import[:]
    proto.opset_import.extend(keep)
    return proto.SerializeToString()


def ort_calibrator_ranges(prepared: bytes, samples: torch.Tensor, batch: int, method: str, tmp: Path,
                          num_bins: int | None = None):
    """onnxruntime's own calibrator's ranges (``TensorsData``) and its histograms' edges
    (at ``num_bins`` histogram bins, else onnxruntime's default)."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    from bnrecal.service.export.int8.quantizer import quantizable_op_types

    source = tmp / "prepared.onnx"
    source.write_bytes(prepared)

    methods = {"percentile": CalibrationMethod.Percentile, "entropy": CalibrationMethod.Entropy}
    with contextlib.redirect_stdout(io.StringIO()):
        calibrator = create_calibrator(
            source, quantizable_op_types(), augmented_model_path=str(tmp / "augmented.onnx"),
            calibrate_method=methods[method], extra_options={} if num_bins is None else {"num_bins": num_bins},
        )
        calibrator.collect_data(batch_reader(samples, batch))
        ranges = calibrator.compute_data()
    edges = {name: entry[1] for name, entry in calibrator.collector.histogram_dict.items()}
    return ranges, edges


class OutlierNet(nn.Module):
    """A net INT8 per-tensor activations hurt: one channel of the BN output is a thousand
    times larger than the others (and read back scaled down by the head), so a per-tensor
    range fitted to it leaves the other channels a level or two."""

    def __init__(self, classes: int = 6, size: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * size * size, classes)
        with torch.no_grad():
            self.bn.weight[0] = 1000.0
            self.head.weight.view(classes, 8, size * size)[:, 0] /= 1000.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)).flatten(1))


def write_outlier_inputs(folder: Path) -> dict[str, Path]:
    """The outlier net (INT8 per-tensor activations cost it real top-1) as a run's inputs: its
    stale checkpoint, calibration data, and evaluation data labelled by the recalibrated FP32
    model itself (so every INT8 miss is quantization's)."""
    torch.manual_seed(3)
    model = OutlierNet()
    calibration, evaluation = torch.randn(64, 3, 8, 8), torch.randn(128, 3, 8, 8)
    torch.save(model.state_dict(), folder / "stale.pt")
    model.bn.momentum = None  # the recalibrated model: BN statistics of the calibration data
    model.train()
    with torch.no_grad():
        model(calibration)
        labels = model.eval()(evaluation).argmax(dim=1).numpy()
    np.save(folder / "x.npy", calibration.numpy())
    np.savez(folder / "eval.npz", x=evaluation.numpy(), y=labels)
    return {"checkpoint": folder / "stale.pt", "data": folder / "x.npy", "eval": folder / "eval.npz"}
