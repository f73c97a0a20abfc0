"""The warm pool a caller's runs take their ranks from, set for a context (``warm_ranks``).

A caller that runs many jobs in a row in one process (a test module, an architecture search
calling ``bnrecal.recalibrate`` per subnet) keeps the ranks of one run for the next of the
same shape, as the server's jobs do, without a pool in any public signature. Import-light:
no Ray until a pool is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bnrecal.workers.ranks.gangs.pool import WarmPool

_current: ContextVar[WarmPool | None] = ContextVar("bnrecal_warm_pool", default=None)


def current_pool() -> WarmPool | None:
    """The pool ``warm_ranks`` set for this context, if any."""
    return _current.get()


@contextlib.contextmanager
def warm_ranks(pool: WarmPool) -> Iterator[None]:
    """Within it, runs on Ray that are given no pool (``bnrecal.recalibrate``, the command
    line's ``calibrate`` and ``sweep`` called in this process) take their ranks from ``pool``
    (warm actors of an earlier run of the same shape) and leave them there; a failed or
    cancelled run's ranks are killed, never kept (``workers.ranks.gangs.pool``)."""
    token = _current.set(pool)
    try:
        yield
    finally:
        _current.reset(token)
