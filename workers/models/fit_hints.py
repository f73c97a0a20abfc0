"""What to do about a checkpoint that does not fit its architecture: which of ``arch`` /
``model_kwargs`` to check, and the ``num_classes`` a checkpoint's classifier head implies.

A list of missing keys says what is wrong, not what to change: a newcomer with a
checkpoint of another architecture, or a 10-class head on a 1000-class default, needs
the setting to change. The hint names both spellings, the job spec's field and the
command line's flag, since the same error reaches both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

Shape = tuple[int, ...]

ANOTHER_ARCHITECTURE = 0.5
"""Below this share of the model's keys found in the checkpoint, it is another architecture's."""


def module_of(key: str) -> str:
    """``layer1.0.conv1.weight`` -> ``layer1.0.conv1``."""
    return key.rpartition(".")[0]


def head_classes(shapes: Mapping[str, tuple[Shape, Shape]], model_order: Sequence[str]) -> tuple[int, int] | None:
    """(classes in the checkpoint, classes in the model) when the only shape mismatches are
    the output size of the model's last layer with parameters (its classifier head); else None."""
    if not shapes or not model_order:
        return None
    modules = {module_of(key) for key in shapes}
    if len(modules) != 1:
        return None
    head = modules.pop()
    first = next(index for index, key in enumerate(model_order) if module_of(key) == head)
    if any(module_of(key) != head and not key.endswith("num_batches_tracked") for key in model_order[first:]):
        return None  # not the last layer: a width or depth difference, not the classes
    outputs = set()
    for stored, expected in shapes.values():
        if not stored or len(stored) != len(expected) or stored[1:] != expected[1:]:
            return None
        outputs.add((stored[0], expected[0]))
    return outputs.pop() if len(outputs) == 1 else None


def checkpoint_hint(
    found: int,
    missing: Sequence[str],
    unexpected: Sequence[str],
    shapes: Mapping[str, tuple[Shape, Shape]],
    model_order: Sequence[str],
) -> tuple[str, str]:
    """The hint that ends a checkpoint error, and the spec field it points at
    (``arch``, ``model_kwargs``, or ``checkpoint`` when nothing better can be said)."""
    total = max(len(model_order), 1)
    if (missing or unexpected) and found / total < ANOTHER_ARCHITECTURE:
        return (
            f"only {found} of the model's {len(model_order)} tensors are in the checkpoint: it looks like "
            "another architecture's; check arch (--arch)",
            "arch",
        )
    if missing or unexpected:
        return "check arch (--arch) for another variant of the model, and model_kwargs (--model-kwargs)", "arch"
    classes = head_classes(shapes, model_order)
    if classes is not None:
        stored, expected = classes
        kwargs = json.dumps({"num_classes": stored})
        return (
            f"only the classifier head differs: the checkpoint has {stored} classes, the model {expected}; "
            f"set model_kwargs {kwargs} (--model-kwargs '{kwargs}')",
            "model_kwargs",
        )
    if shapes:
        return "layer sizes differ: check model_kwargs (--model-kwargs) for the width or variant, and arch (--arch)", "model_kwargs"
    return "", "checkpoint"
