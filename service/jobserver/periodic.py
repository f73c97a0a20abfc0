"""A server's background chores, each a function called every few seconds in a daemon
thread until the server stops: storage collection, the blob scrub, watching the ledger for
other replicas' changes, probing the Ray cluster. Written once here, so each chore is only
what it does."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


class Periodic:
    """Calls ``tick`` every ``interval_s`` seconds (the first call one interval in) in a
    daemon thread named ``name``, until :meth:`stop` or until ``tick`` returns False.

    An exception from ``tick`` is logged on ``log`` with ``failure`` and the next call comes one
    interval later: a bad moment (a locked database, an unreachable bucket) must not end a
    chore. A long ``tick`` may call :meth:`wait` to pause and learn whether to give up."""

    def __init__(self, name: str, interval_s: float, tick: Callable[[], bool | None], failure: str,
                 log: logging.Logger) -> None:
        self.name = name
        self.interval_s = interval_s
        self.tick = tick
        self.failure = failure
        self.log = log
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (not at all when the interval is 0 or less: the chore is off)."""
        if self.interval_s <= 0:
            return
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Ask the thread to stop and wait up to ``timeout`` seconds (None: do not wait) for
        the call under way to end."""
        self._stop.set()
        if self._thread is not None and timeout is not None:
            self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds`` inside a ``tick``; True when the chore is being stopped."""
        return self._stop.wait(seconds)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self.tick() is False:
                    return
            except Exception:  # noqa: BLE001 - see the class docstring
                self.log.exception("%s; trying again in %s s", self.failure, self.interval_s)
