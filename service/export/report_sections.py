"""The report's ``onnx`` and ``int8`` sections (docs/report.md, "The `onnx` section" and
"The other sections"), typed: the exports build them and
the run report holds them as they are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from bnrecal.service.export.cpu import CpuFeatures
from bnrecal.service.report_part import ReportPart


class RuntimeEntry(ReportPart):
    """One runtime's run of an exported file (``runtimes.onnxruntime``, ``runtimes.openvino``):
    whether it ran, its version and its largest difference from the section's reference, or
    why it did not run. An INT8 file's entries also say how far each runtime is from the
    file's own arithmetic (``max_abs_diff_to_qdq``), OpenVINO's from onnxruntime's outputs, and
    whether the runtime ``saturates`` on this CPU (``reason`` says how it was found)."""

    OMIT_WHEN_NONE = frozenset({"version", "max_abs_diff", "max_abs_diff_to_qdq", "max_abs_diff_to_onnxruntime",
                                "saturates", "reason"})

    ran: bool
    version: str | None = None
    max_abs_diff: float | None = None
    max_abs_diff_to_qdq: float | None = None
    max_abs_diff_to_onnxruntime: float | None = None
    saturates: bool | None = None
    reason: str | None = None


class RuntimeChecks(ReportPart):
    """Which runtimes ran the file (``runtimes``), against which ``reference``."""

    reference: str
    onnxruntime: RuntimeEntry
    openvino: RuntimeEntry


class UnfoldedLayer(ReportPart):
    """A BN left in the graph (``unfolded[]``), and why it could not be folded."""

    name: str
    reason: str


class OnnxSection(ReportPart):
    """The folded FP32/FP16 export (``onnx``): its format, the fold audit, its verification."""

    opset: int
    dtype: Literal["float32", "float16"]
    batch: Literal["dynamic"] | int
    batchnorm_nodes: int
    folded: int
    unfolded: list[UnfoldedLayer]
    max_abs_diff: float
    max_rel_diff: float
    verified_batches: list[int]
    bytes: int
    runtimes: RuntimeChecks


class OpenVinoSection(ReportPart):
    """OpenVINO's own files of an exported model (``openvino``, ``openvino_int8``): what they
    were made from, their sizes, and their run in OpenVINO on the verified batches against
    the same ONNX file in onnxruntime (as written) and in OpenVINO."""

    made_from: Literal["the verified FP32 ONNX export", "the checked INT8 ONNX file"]
    version: str
    xml_bytes: int
    bin_bytes: int
    verified_batches: list[int]
    outputs_max_abs: float
    max_abs_diff_to_onnxruntime: float
    max_abs_diff_to_onnx_in_openvino: float
    seconds: float


class FloatOp(ReportPart):
    """An op of the INT8 file left in float (``ops_float[]``), and why."""

    name: str
    op_type: str
    reason: str


class KeptFloat(ReportPart):
    """An op the accuracy guard kept in float (``guard.kept_float[]``): what keeping it alone
    gained on the selection part, and the selection top-1 once it was kept."""

    OMIT_WHEN_NONE = frozenset({"selection_top1_after"})

    name: str
    op_type: str
    top1_gain_alone_points: float
    selection_top1_after: float | None = None


class GuardSelection(ReportPart):
    """The guard's selection part: which samples, and the top-1 it chose by."""

    OMIT_WHEN_NONE = frozenset({"int8_top1_after"})

    samples: int
    which: str
    fp32_top1: float
    int8_top1_before: float
    int8_top1_after: float | None = None


class GuardReportPart(ReportPart):
    """The samples the reported accuracies come from, which took no part in the choice."""

    OMIT_WHEN_NONE = frozenset({"samples"})

    which: str
    samples: int | None = None


class Int8Guard(ReportPart):
    """The accuracy guard (``int8.guard``, docs/int8.md "The accuracy guard")."""

    OMIT_WHEN_NONE = frozenset({"held", "kept_float", "models_measured", "reason", "report_drop_points",
                                "held_on_report"})

    max_top1_drop: float
    selection: GuardSelection
    report: GuardReportPart
    held: bool | None = None
    kept_float: list[KeptFloat] | None = None
    models_measured: int | None = None
    reason: str | None = None
    report_drop_points: float | None = None
    held_on_report: bool | None = None


class TopScores(ReportPart):
    """Top-1 and top-5, as fractions."""

    top1: float
    top5: float


class Int8Evaluation(ReportPart):
    """The FP32 and INT8 files' accuracy (and the stale model's, exported and quantized
    alike) on the labelled evaluation data (``int8.evaluation``)."""

    OMIT_WHEN_NONE = frozenset({"stale_fp32", "stale_int8"})

    samples: int
    fp32: TopScores
    int8: TopScores
    stale_fp32: TopScores | None = None
    stale_int8: TopScores | None = None
    top1_drop_points: float


class Latency(ReportPart):
    """onnxruntime's median latency of the FP32 and INT8 files, in milliseconds."""

    batch: int
    fp32: float
    int8: float


class RangesAsMinmax(ReportPart):
    """How many tensors a histogram method gave exactly their min/max range."""

    OMIT_WHEN_NONE = frozenset({"note"})

    tensors: int
    of: int
    note: str | None = None


@dataclass(frozen=True)
class Int8Checks:
    """The INT8 file against the FP32 export on the verified batches: the largest difference,
    the FP32 outputs' scale, the file's own arithmetic's difference (``qdq_max_abs_diff``),
    each runtime's agreement, the CPU they ran on and the runtimes that saturate there (fields
    of :class:`Int8Section`)."""

    max_abs_diff: float
    fp32_max_abs: float
    qdq_max_abs_diff: float
    runtimes: RuntimeChecks
    cpu: CpuFeatures
    saturates: list[str]


@dataclass(frozen=True)
class GraphSummary:
    """What the INT8 graph holds: the ops quantized by type, those left in float with their
    reasons, the Relu/Clip merged into a range, the ops on shapes, and its Q/DQ nodes
    (fields of :class:`Int8Section`)."""

    ops_quantized: dict[str, int]
    ops_float: list[FloatOp]
    ops_merged: int
    ops_on_shapes: int
    quantize_linear_nodes: int
    dequantize_linear_nodes: int


class Int8Section(ReportPart):
    """The INT8 QDQ export (``int8``): how it was quantized, its ranges' pass, the checks, the
    guard and the evaluation; ``written`` false with ``failure`` when the guard failed (the
    fields after the ranges are then absent)."""

    OMIT_WHEN_NONE = frozenset({
        "op_types", "bins", "percentile", "quantized_bins", "ranges_as_minmax", "guard", "evaluation", "failure",
        "max_abs_diff", "fp32_max_abs", "runtimes", "verified_batches", "ops_quantized", "ops_float", "ops_merged",
        "ops_on_shapes", "quantize_linear_nodes", "dequantize_linear_nodes", "bytes", "fp32_bytes", "latency_ms",
        "written", "attempts", "retried_failures", "weights_why", "qdq_max_abs_diff", "cpu", "saturates",
    })

    target: str
    method: str
    weight_type: str
    weights: str
    activation_type: str
    symmetric_activations: bool
    per_channel: bool
    reduce_range: bool
    weights_why: str | None = None
    format: str
    writer: str
    tensors_calibrated: int
    samples: int
    world_size: int
    collectives: list[int]
    range_seconds: float
    op_types: list[str] | None = None
    bins: int | None = None
    percentile: float | None = None
    quantized_bins: int | None = None
    ranges_as_minmax: RangesAsMinmax | None = None
    guard: Int8Guard | None = None
    evaluation: Int8Evaluation | None = None
    failure: str | None = None
    max_abs_diff: float | None = None
    fp32_max_abs: float | None = None
    qdq_max_abs_diff: float | None = None
    runtimes: RuntimeChecks | None = None
    cpu: CpuFeatures | None = None
    saturates: list[str] | None = None
    verified_batches: list[int] | None = None
    ops_quantized: dict[str, int] | None = None
    ops_float: list[FloatOp] | None = None
    ops_merged: int | None = None
    ops_on_shapes: int | None = None
    quantize_linear_nodes: int | None = None
    dequantize_linear_nodes: int | None = None
    bytes: int | None = None
    fp32_bytes: int | None = None
    latency_ms: Latency | None = None
    written: bool | None = None
    attempts: int | None = Field(default=None, description="passes of the INT8 export run, as the top level counts")
    retried_failures: list[str] | None = None
