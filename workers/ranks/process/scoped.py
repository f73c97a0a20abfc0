"""What a process keeps for a job's scope between the calls of its later phases, beside the
samples it keeps (``workers.data.reading.kept``): the exporter's trace, so that the next
export of a model of the same structure in the scope (a sweep's next cell, the stale model)
puts its weights into that graph instead of tracing again (docs/onnx.md, "One trace for a
sweep").

It follows the kept samples' rules: a rank actor keeps one scope at a time (a new scope drops
what an older one left, so a warm rank never hands one job's objects to another job), and
:func:`release_scope` drops a scope's objects with its samples when its run (or sweep) ends.
"""

from __future__ import annotations

import threading
from typing import TypeVar, cast

from bnrecal.workers.data.reading.kept import STORE, KeptCounts, release_kept

T = TypeVar("T")

_LOCK = threading.Lock()
_OBJECTS: dict[str, dict[type, object]] = {}
"""Per scope, one object of each kind, keyed by its type."""


def scope_object(scope: str, kind: type[T]) -> T:
    """The ``kind`` this process keeps for ``scope``, made (``kind()``) on first use."""
    with _LOCK:
        if STORE.one_scope:  # a rank actor: one job's scope at a time
            for other in [kept for kept in _OBJECTS if kept != scope]:
                del _OBJECTS[other]
        objects = _OBJECTS.setdefault(scope, {})
        if kind not in objects:
            objects[kind] = kind()
        return cast(T, objects[kind])


def object_scopes() -> list[str]:
    """The scopes this process keeps objects for now."""
    with _LOCK:
        return list(_OBJECTS)


def release_scope(scope: str) -> KeptCounts:
    """Drop what this process kept for ``scope``: its objects and its samples; what the
    scope's passes decoded and reused (``release_kept``'s counts)."""
    with _LOCK:
        _OBJECTS.pop(scope, None)
    return release_kept(scope)
