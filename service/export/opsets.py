"""The ONNX opsets an export can target (a module of its own, so that declaring the run
options loads neither torch nor onnx)."""

from __future__ import annotations

DEFAULT_OPSET = 18
"""ONNX opset of an export unless the user picks one."""

DYNAMO_MIN_OPSET = 18
DYNAMO_MAX_OPSET = 23
TORCHSCRIPT_MIN_OPSET = 13
TORCHSCRIPT_MAX_OPSET = 20
SUPPORTED_OPSETS = range(TORCHSCRIPT_MIN_OPSET, DYNAMO_MAX_OPSET + 1)
