"""``bnrecal.export_onnx``: a live model to folded, verified ONNX (contract section 6)."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from workers.errors import SpecError

from service.run.options import DEFAULT_OPSET

VERIFY_SAMPLES = 8
"""Samples of ``sample`` the export is verified on (batch 1 and a batch of these)."""


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike[str],
    sample: torch.Tensor,
    *,
    opset: int = DEFAULT_OPSET,
    dynamic_batch: bool = True,
) -> dict[str, Any]:
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
