"""``bnrecal.export_onnx``, ``export_openvino`` and ``quantize``: a live model to folded,
verified ONNX, to OpenVINO's own files, and to a checked INT8 file (docs/onnx.md, docs/int8.md)."""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bnrecal.errors import SpecError

from bnrecal.service.export.products import ir_xml_path
from bnrecal.service.export.verification import VERIFY_SAMPLES
from bnrecal.service.run.options import DEFAULT_OPSET

if TYPE_CHECKING:  # the exporters load where a call uses them
    from bnrecal.service.export.int8.options import Int8Options
    from bnrecal.service.export.report_sections import Int8Section, OnnxSection, OpenVinoSection



def export_onnx(
    model: nn.Module,
    path: str | os.PathLike[str],
    sample: torch.Tensor,
    *,
    opset: int = DEFAULT_OPSET,
    dynamic_batch: bool = True,
) -> OnnxSection:
    """Export ``model`` in eval mode to ``path`` as one self-contained ONNX file with every
    legal Conv/Linear/BN fold done, verified in onnxruntime against PyTorch on ``sample``
    (a batch of the model's input); returns the report's ``onnx`` section (``folded``,
    ``unfolded``, ``max_abs_diff``...). A failed verification raises ``ExportError`` and
    writes nothing. The model itself is left as it was (a copy is folded)."""
    from ..export import export_folded_onnx

    if not isinstance(model, nn.Module):
        raise SpecError(f"model must be a torch.nn.Module, got {type(model).__name__}", field="model")
    if not isinstance(sample, torch.Tensor) or sample.dim() < 1 or sample.shape[0] < 1:
        raise SpecError("sample must be a tensor holding a batch of the model's input", field="sample")
    samples = sample.detach().cpu().to(torch.float32)[:VERIFY_SAMPLES]
    if samples.shape[0] < 2:
        samples = torch.cat([samples, samples])
    exported = copy.deepcopy(model).cpu().eval()
    return export_folded_onnx(exported, samples, path, opset=opset, dynamic_batch=dynamic_batch)


def export_openvino(
    model: nn.Module,
    path: str | os.PathLike[str],
    sample: torch.Tensor,
    *,
    opset: int = DEFAULT_OPSET,
    dynamic_batch: bool = True,
) -> OpenVinoSection:
    """Export ``model`` as OpenVINO's own files, ``path`` (the ``.xml``) and its ``.bin``
    beside: made by OpenVINO from the folded export :func:`export_onnx` verifies, then run on
    ``sample`` against the ONNX file in OpenVINO and in onnxruntime (docs/onnx.md, "OpenVINO
    IR"), as a job's ``openvino`` output is. Returns the report's ``openvino`` section; a
    failed check raises ``ExportError`` and writes nothing. The model is left as it was."""
    import tempfile
    from pathlib import Path

    from ..export.openvino_ir import make_openvino_ir

    xml = ir_xml_path(path, "path")
    with tempfile.TemporaryDirectory(prefix="bnrecal-openvino-") as tmp:
        onnx = Path(tmp) / "model.onnx"
        export_onnx(model, onnx, sample, opset=opset, dynamic_batch=dynamic_batch)
        made = make_openvino_ir(onnx.read_bytes(), _ir_batches(sample, dynamic_batch), int8=False)
    made.write(xml)
    return made.section


def _ir_batches(sample: torch.Tensor, dynamic_batch: bool) -> list[Any]:
    """The batches an IR is checked on, as a job's are: one sample and the first
    ``VERIFY_SAMPLES`` (the whole batch of a fixed-batch export)."""
    data = sample.detach().cpu().to(torch.float32)[:VERIFY_SAMPLES].numpy()
    return [data[:1], data] if dynamic_batch and len(data) > 1 else [data]


def quantize(
    model: nn.Module,
    path: str | os.PathLike[str],
    data: torch.Tensor,
    *,
    options: Int8Options | dict[str, Any] | None = None,
    eval_data: tuple[torch.Tensor, torch.Tensor] | None = None,
    batch_size: int = 32,
    opset: int = DEFAULT_OPSET,
    openvino: str | os.PathLike[str] | None = None,
) -> Int8Section:
    """Export ``model`` folded (as :func:`export_onnx`) and quantized to INT8 in QDQ format at
    ``path``, activation ranges from the calibration samples ``data`` (a tensor, one sample
    per row), gathered in this process: the same file a job's ranks make from the same data.
    ``options`` are an :class:`Int8Options` or the job's ``int8`` object (``method``, ``per_channel``, ``keep_float``,
    ``max_top1_drop``...); with ``eval_data`` (inputs, labels) the report's ``evaluation``
    gives top-1/top-5 of FP32 and INT8, and ``max_top1_drop`` is enforced. Returns the
    report's ``int8`` section; a failed check or guard raises ``ExportError``, writing nothing.
    With ``openvino`` (an ``.xml`` path) the INT8 file is also written as OpenVINO's own files,
    made and checked as a job's ``openvino_int8`` output is (a failed check writes neither
    file). The model itself is left as it was."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from bnrecal.workers.data import describe_dataset

    from ..export.int8.checks import LabelledBatches
    from ..export.int8.options import int8_options
    from ..run.outputs.int8 import quantize_export
    from ..run.outputs.onnx_passes import InProcessPasses

    xml = ir_xml_path(openvino, "openvino") if openvino is not None else None
    checked = int8_options(options, "options")
    if checked.max_top1_drop is not None and eval_data is None:
        raise SpecError("options.max_top1_drop needs eval_data=(inputs, labels) to measure top-1 on", field="eval_data")
    if not isinstance(data, torch.Tensor) or data.dim() < 2 or data.shape[0] < 1:
        raise SpecError("data must be a tensor of calibration samples, one per row", field="data")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise SpecError("batch_size must be a positive integer", field="batch_size")
    samples = data.detach().cpu().to(torch.float32)
    evaluation = None
    if eval_data is not None:
        inputs, labels = eval_data
        x = inputs.detach().cpu().to(torch.float32).numpy()
        y = labels.detach().cpu().numpy().astype(np.int64)
        if len(x) != len(y):
            raise SpecError(f"eval_data has {len(x)} inputs and {len(y)} labels", field="eval_data")
        evaluation = LabelledBatches(
            [x[i : i + batch_size] for i in range(0, len(x), batch_size)],
            [y[i : i + batch_size] for i in range(0, len(y), batch_size)],
        )
    with tempfile.TemporaryDirectory(prefix="bnrecal-int8-") as tmp:
        fp32 = Path(tmp) / "fp32.onnx"
        export_onnx(model, fp32, samples[:VERIFY_SAMPLES], opset=opset)
        np.save(Path(tmp) / "data.npy", samples.numpy())
        dataset = describe_dataset(Path(tmp) / "data.npy")
        passes = InProcessPasses(dataset, batch_size, evaluation=evaluation)
        quantized = quantize_export(fp32.read_bytes(), checked, passes, samples)
    if xml is not None:
        from ..export.openvino_ir import make_openvino_ir

        made = make_openvino_ir(quantized.model, _ir_batches(samples, True), int8=True)
    quantized.write(path)
    if xml is not None:
        made.write(xml)
    return quantized.section
