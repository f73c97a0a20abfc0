"""BatchNorm folding: in PyTorch on the model's real dataflow (``in_torch``), on an exported
ONNX graph for what is left (``in_onnx``), and the float64 arithmetic both share
(``arithmetic``)."""
