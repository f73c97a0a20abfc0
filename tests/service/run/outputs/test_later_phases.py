"""How a run's exports are handed to its ranks (service/run/outputs/later_phases.py): one call with one
trace for a world of one, one call per export where there is a rank for each."""

from __future__ import annotations

from bnrecal.service.run.outputs.exports import ExportAsk
from bnrecal.service.run.outputs.later_phases import INT8_BASE, STALE_BASE, RunOutputs, export_asks, share_asks
from bnrecal.service.export.int8.options import Int8Options

ONNX = ExportAsk(dtype="float16")


def test_one_rank_makes_every_export_in_one_call_and_two_share_them():
    asks = export_asks(RunOutputs(onnx=__file__, int8=__file__, int8_options=Int8Options()), stale=True)
    assert asks == (INT8_BASE, STALE_BASE)  # a float32 ONNX file is the INT8 file's base: made once
    assert share_asks(asks, 1) == [asks]
    assert share_asks(asks, 2) == [(INT8_BASE,), (STALE_BASE,)]
    assert share_asks(asks, 4) == [(INT8_BASE,), (STALE_BASE,)]  # no empty call
    three = (ONNX, INT8_BASE, STALE_BASE)
    assert share_asks(three, 2) == [(ONNX, STALE_BASE), (INT8_BASE,)]
    assert share_asks(three, 3) == [(ONNX,), (INT8_BASE,), (STALE_BASE,)]
    assert share_asks((ONNX,), 2) == [(ONNX,)]
