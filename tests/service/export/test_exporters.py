"""The dynamo export that builds torch's translation table once a process (``torchlib_registry``)
writes, byte for byte, what ``torch.onnx.export(dynamo=True)`` writes with the same options: a
fixed and a dynamic batch (its axis named ``batch``), at torchlib's own opset and above it."""

from __future__ import annotations

import onnx_ir as ir
import pytest
import torch

from bnrecal.service.export.exporters import BATCH_AXIS, INPUT_NAME, _dynamo_entry, export_unfolded, output_names
from tests.nets import mixed_net


def public_export(model: torch.nn.Module, example: torch.Tensor, opset: int, dynamic_batch: bool) -> ir.Model:
    """The exporter's public call, with the options bnrecal exports with."""
    dynamic_shapes = ({0: torch.export.Dim(BATCH_AXIS)},) if dynamic_batch else None
    return torch.onnx.export(model, (example,), dynamo=True, optimize=False, external_data=False, opset_version=opset,
                             dynamic_shapes=dynamic_shapes, input_names=[INPUT_NAME], output_names=output_names(1),
                             verbose=False).model


@pytest.mark.parametrize(("opset", "dynamic_batch"), [(18, False), (18, True), (21, True)])
def test_the_export_with_its_table_built_once_is_torch_onnx_exports_file(opset, dynamic_batch):
    assert _dynamo_entry() is not None  # the pinned torch has the entry: the path under test is taken
    torch.manual_seed(0)
    model = mixed_net().eval()
    example = torch.randn(4, 3, 6, 5)
    ours = [export_unfolded(model, example, opset=opset, dynamic_batch=dynamic_batch, n_outputs=1, exporter="dynamo")
            for _ in range(2)]  # the second export reuses the first one's table
    theirs = public_export(model, example, opset, dynamic_batch)
    expected = ir.serde.serialize_model(theirs).SerializeToString()
    for export in ours:
        assert export.exporter == "dynamo"
        assert ir.serde.serialize_model(export.model).SerializeToString() == expected
    if dynamic_batch:
        assert ours[0].model.graph.inputs[0].shape[0] == ir.SymbolicDim(BATCH_AXIS)
