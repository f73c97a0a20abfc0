"""Close-name hints for errors about a name the user typed (an architecture, a class)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def did_you_mean(name: str, candidates: Sequence[str]) -> str:
    """A ' (did you mean ...?)' hint listing up to three close matches of ``name``, or ''.

    Matches are looked for as typed first, then ignoring case (``resnetforimageclassification``
    still finds ``ResNetForImageClassification``), so a typo costs the user one retry.
    """
    matches = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    if not matches:
        lowered = {c.lower(): c for c in candidates}
        matches = [lowered[m] for m in difflib.get_close_matches(name.lower(), list(lowered), n=3)]
    return f" (did you mean {', '.join(matches)}?)" if matches else ""


def first_input_layer(model: object) -> tuple[str, int, int] | None:
    """The layer that first takes the model's input, as ``(kind, channels or features,
    spatial dims)``: ``("conv", 3, 2)`` for a Conv2d of 3 input channels, ``("linear", 64, 0)``
    for a Linear of 64 features. The first convolution or linear layer the model registers
    (duck-typed: no torch needed to ask), or None."""
    modules = getattr(model, "modules", None)
    if modules is None:
        return None
    for module in modules():
        channels, kernel = getattr(module, "in_channels", None), getattr(module, "kernel_size", None)
        if isinstance(channels, int) and isinstance(kernel, tuple) and not getattr(module, "transposed", False):
            return "conv", channels, len(kernel)
        features = getattr(module, "in_features", None)
        if isinstance(features, int) and hasattr(module, "weight"):
            return "linear", features, 0
    return None


def sample_shape_hint(model: object, sample_shape: Sequence[int]) -> str:
    """Why samples of ``sample_shape`` do not fit this model, and what to do, when the layer
    that takes the input tells: channels-last data (N, H, W, C), the wrong channel count, a
    missing channel axis, the wrong feature count; '' otherwise. Worded to follow "the model
    rejects samples of shape (16, 16, 3): "."""
    layer = first_input_layer(model)
    if layer is None or not sample_shape:
        return ""
    kind, channels, spatial = layer
    shape = tuple(int(size) for size in sample_shape)
    if kind == "linear":
        return "" if shape[-1] == channels else f"its first layer takes {channels} features in the last dimension"
    takes = f"({channels}, {', '.join('DHW'[3 - spatial:])})" if spatial <= 3 else f"({channels}, ...)"
    if len(shape) == spatial + 1 and shape[0] == channels:
        return ""
    if len(shape) == spatial + 1 and shape[-1] == channels:
        order = ", ".join(["0", str(spatial + 1), *(str(axis) for axis in range(1, spatial + 1))])
        return (
            f"it takes {takes}; your data looks channels-last: transpose it to channels-first, "
            f"e.g. x.transpose({order})"
        )
    if len(shape) == spatial and channels == 1:
        return f"it takes {takes}: add the channel axis, e.g. x[:, None]"
    if len(shape) == spatial + 1:
        plural = "s" if shape[0] != 1 else ""
        return f"it takes {takes}, these have {shape[0]} channel{plural}"
    return f"it takes {takes}"
