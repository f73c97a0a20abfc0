"""The ``max_top1_drop`` guard: when the INT8 model loses more top-1 than allowed against
the FP32 one, keep its most sensitive ops in float, one at a time, until it holds
(docs/int8.md, "The accuracy guard: `max_top1_drop`").

The guard does not grade its own homework: the evaluation data is split in two fixed
parts (``split_for_guard``). Sensitivity is measured and the float ops chosen on the
*selection* part; every accuracy the report gives is measured on the other, *report*,
part, which took no part in the choice. Sensitivity is measured, not guessed: each op that
runs in INT8 is kept in float alone (the same ranges, onnxruntime's quantizer writing the
graph again); ops are then kept in float in order of the top-1 points each recovered alone
(graph order breaks ties), re-measuring after each, until the drop on the selection part
is within the bound, or ``max_float_ops`` ops are float: then ``Int8GuardUnreachableError``.

Units: top-1 values are fractions (as everywhere in the report); every difference of
them (a drop, a gain, the bound) is in points, and named ``..._points``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bnrecal.errors import Int8GuardUnreachableError

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.int8.quantizer import PreparedModel, quantized_node_names
from bnrecal.service.export.report_sections import KeptFloat

SELECTION_RULE = "evaluation samples at even positions (0, 2, 4, ...)"
REPORT_RULE = "evaluation samples at odd positions (1, 3, 5, ...)"
CANDIDATES_PER_PASS = 16
"""Candidate INT8 models (one op kept float each) scored in one pass over the selection
samples: every pass reads the data once, and the models it holds stay within memory."""


@dataclass
class Guarded:
    """The model that holds the bound on the selection part, the ops kept float for it, and
    its selection top-1."""

    model: bytes
    top1: float
    kept: list[KeptFloat] = field(default_factory=list)
    measured: int = 0


QdqWriter = Callable[[Sequence[Sequence[str]]], list[bytes]]
"""The QDQ file onnxruntime's quantizer writes with the same ranges and options for each
list of nodes kept float (``write_qdq``), several at once where they can be spread."""


def enforce_top1_drop(
    prepared: PreparedModel,
    options: Int8Options,
    exclude: Sequence[str],
    model: bytes,
    fp32_top1: float,
    int8_top1: float,
    top1_of: Callable[[Sequence[bytes]], list[float]],
    write: QdqWriter,
) -> Guarded:
    """The INT8 model within ``options.max_top1_drop`` points of ``fp32_top1`` as ``top1_of``
    measures it (on the selection part; it scores several models in one pass over the data:
    the sensitivity of each op alone in passes of ``CANDIDATES_PER_PASS``, then one pass per
    op kept), or ``Int8GuardUnreachableError`` when keeping up to ``max_float_ops`` ops in
    float cannot make it hold. ``write`` writes each candidate file (the candidates of a pass
    side by side on the ranks)."""
    bound = options.max_top1_drop

    def drop(top1: float) -> float:
        return 100.0 * (fp32_top1 - top1)

    if bound is None or drop(int8_top1) <= bound:
        return Guarded(model, int8_top1)
    candidates = quantized_node_names(model, options)
    limit = options.max_float_ops if options.max_float_ops is not None else len(candidates) // 2
    if limit == 0 or not candidates:
        raise Int8GuardUnreachableError(
            f"INT8 top-1 {int8_top1:.2%} is {drop(int8_top1):.2f} points below FP32 {fp32_top1:.2%} on the guard's "
            f"selection samples, more than int8.max_top1_drop {bound:g}, and no op may be kept in float "
            "(int8.max_float_ops 0); no INT8 file written",
            [],
        )
    gain: dict[str, float] = {}
    for first in range(0, len(candidates), CANDIDATES_PER_PASS):
        names = candidates[first : first + CANDIDATES_PER_PASS]
        tops = top1_of(write([[*exclude, name] for name in names]))
        gain.update({name: 100.0 * (top1 - int8_top1) for name, top1 in zip(names, tops, strict=True)})
    order = sorted(candidates, key=lambda name: (-gain[name], candidates.index(name)))
    kept: list[KeptFloat] = []
    top1 = int8_top1
    for name in order[:limit]:
        kept.append(KeptFloat(name=name, op_type=prepared.op_types.get(name, ""), top1_gain_alone_points=gain[name]))
        model = write([[*exclude, *(k.name for k in kept)]])[0]
        top1 = top1_of([model])[0]
        kept[-1].selection_top1_after = top1
        if drop(top1) <= bound:
            return Guarded(model, top1, kept, measured=len(candidates) + len(kept))
    raise Int8GuardUnreachableError(
        f"INT8 top-1 stays {drop(top1):.2f} points below FP32 {fp32_top1:.2%} on the guard's selection samples with "
        f"the {len(kept)} most sensitive ops kept in float ({', '.join(k.name for k in kept)}): "
        f"int8.max_top1_drop {bound:g} cannot hold within int8.max_float_ops {limit}; no INT8 file written",
        kept,
    )
