"""INT8 (QDQ) export of a folded FP32 ONNX model (docs/int8.md).

The options (``options.Int8Options``, pure pydantic: the job spec and the command line
take them without loading onnxruntime), onnxruntime's pre-processing and the tensors to
calibrate (``quantizer``), the ranges as onnxruntime's quantizer takes them and the QDQ
graph written by onnxruntime's own ``QDQQuantizer`` (``quantizer``), its verification and
accuracy (``checks``) and the accuracy guard that keeps the most sensitive ops in float
(``guard``). The ranges themselves are gathered by the ranks (``workers.ranks.ort.rank_pass``);
this room only turns them into a verified file.
"""
