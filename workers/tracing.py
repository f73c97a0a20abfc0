"""One lock for torch's process-wide tracing state.

torch.fx's tracer patches ``torch.nn.Module.__call__`` for the whole process while it traces,
and the ONNX exporters keep process-wide state (dynamo's mode stack, the TorchScript tracer,
the warnings filters). A forward or an export in another thread meanwhile breaks ("module is
not installed as a submodule", "Trying to pop empty mode stack"), or makes a trace fall back
without a word. Where one process does several models' host work at once (a server's job
host running jobs side by side, a sweep's cells side by side), everything that traces or runs
a model's forward there holds :data:`MODEL_TRACING`, so they take turns; a single run never
waits on it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

MODEL_TRACING = threading.RLock()

_P = ParamSpec("_P")
_R = TypeVar("_R")


def holds_tracing(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function``, run holding :data:`MODEL_TRACING` (re-entrant: an export that traces is one turn)."""

    @functools.wraps(function)
    def locked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with MODEL_TRACING:
            return function(*args, **kwargs)

    return locked
