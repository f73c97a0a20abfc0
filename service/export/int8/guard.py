"""The ``max_top1_drop`` guard: when the INT8 model loses more top-1 than allowed against
the FP32 one, keep its most sensitive ops in float, one at a time, until it holds.

Sensitivity is measured, not guessed: each op that runs in INT8 is kept in float alone
(the same ranges, onnxruntime's quantizer writing the graph again) and the top-1 of that
model on the evaluation data is measured; ops are then kept in float in order of the
top-1 each recovered alone (graph order breaks ties), re-measuring after each, until the
drop is within the bound or ``max_float_ops`` ops are float: then the export fails,
saying so. An INT8 file is never silently worse than asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bnrecal.errors import ExportError

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.int8.quantizer import PreparedModel, quantized_node_names, write_qdq


@dataclass
class Guarded:
    """The model that holds the bound, the ops kept float for it (each with the top-1 it
    recovered alone), and its top-1."""

    model: bytes
    top1: float
    kept: list[dict[str, Any]] = field(default_factory=list)
    measured: int = 0


def enforce_top1_drop(
    prepared: PreparedModel,
    data: Any,
    options: Int8Options,
    exclude: Sequence[str],
    model: bytes,
    fp32_top1: float,
    int8_top1: float,
    top1_of: Callable[[bytes], float],
) -> Guarded:
    """The INT8 model within ``options.max_top1_drop`` points (percent) of ``fp32_top1``, or
    ``ExportError`` when keeping up to ``max_float_ops`` ops in float cannot make it hold.
    Top-1 values are fractions, as the report gives them."""
    bound = options.max_top1_drop

    def drop(top1: float) -> float:
        return 100.0 * (fp32_top1 - top1)

    if bound is None or drop(int8_top1) <= bound:
        return Guarded(model, int8_top1)
    candidates = quantized_node_names(model)
    limit = options.max_float_ops if options.max_float_ops is not None else len(candidates) // 2
    if limit == 0 or not candidates:
        raise ExportError(
            f"INT8 top-1 {int8_top1:.2%} is {drop(int8_top1):.2f} points below FP32 {fp32_top1:.2%}, "
            f"more than int8.max_top1_drop {bound:g}, and no op may be kept in float (int8.max_float_ops 0); "
            "no file written"
        )
    recovered: dict[str, float] = {}
    for name in candidates:
        recovered[name] = top1_of(write_qdq(prepared, data, options, [*exclude, name])) - int8_top1
    order = sorted(candidates, key=lambda name: (-recovered[name], candidates.index(name)))
    kept: list[dict[str, Any]] = []
    top1 = int8_top1
    for name in order[:limit]:
        kept.append({"name": name, "op_type": prepared.op_types.get(name, ""), "top1_recovered_alone": recovered[name]})
        model = write_qdq(prepared, data, options, [*exclude, *(k["name"] for k in kept)])
        top1 = top1_of(model)
        kept[-1]["top1_after"] = top1
        if drop(top1) <= bound:
            return Guarded(model, top1, kept, measured=len(candidates) + len(kept))
    raise ExportError(
        f"INT8 top-1 stays {drop(top1):.2f} points below FP32 {fp32_top1:.2%} with the {len(kept)} most "
        f"sensitive ops kept in float ({', '.join(k['name'] for k in kept)}): int8.max_top1_drop {bound:g} cannot "
        f"hold within int8.max_float_ops {limit}; no file written"
    )
