"""Whether the Ray cluster answers, known without asking it on the request path.

A Ray call whose GCS is gone does not fail: it blocks (about a minute, until Ray gives up and
ends the process). So nothing that answers a request asks Ray. A prober thread asks it
(``ray.nodes()``) every ``PROBE_INTERVAL_S`` and keeps the answer with its time; the cluster
counts as unreachable once the last answer is older than ``STALE_AFTER_S`` (a call that hangs
simply never refreshes it), so ``/readyz`` says 503 within 2 s of the cluster going away and
submissions are refused with 503 and ``Retry-After`` at once (docs/api.md, "Operations").

An embedded instance (``bnrecal serve`` without ``RAY_ADDRESS``) is also watched directly:
its GCS process is a child of this one, and once it has exited the instance cannot come back.
The watchdog then tells its listeners once (:meth:`ClusterHealth.on_lost`): the runner fails
the running jobs with the reason, and the server stops the rest of the instance and itself,
so a supervisor restarts it. A cluster joined by address that stops answering is only
reported (503s): Ray reconnects by itself when its GCS returns, and the running jobs go on.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from bnrecal.errors import ServiceUnavailableError

from bnrecal.service.jobserver.cluster.capacity import Node, cluster_nodes
from bnrecal.service.jobserver.periodic import Periodic

log = logging.getLogger("bnrecal.cluster")

PROBE_INTERVAL_S = 0.5
"""How often the prober asks Ray for its nodes."""

STALE_AFTER_S = 1.5
"""An answer older than this means the cluster is unreachable (the last call still hangs)."""


@dataclass(frozen=True)
class ClusterState:
    """The cluster as last seen: reachable or why not, and its alive nodes (empty when unreachable)."""

    reachable: bool
    reason: str
    nodes: tuple[Node, ...] = ()

    @property
    def cpus(self) -> float:
        """CPUs of the alive nodes."""
        return sum(node.cpus for node in self.nodes)

    @property
    def gpus(self) -> float:
        """GPUs of the alive nodes."""
        return sum(node.gpus for node in self.nodes)


class ClusterHealth:
    """The cached view of the cluster the server answers from (see the module docstring)."""

    def __init__(self, embedded_gcs: subprocess.Popen[bytes] | None = None, ask: Callable[[], list[Node]] | None = None) -> None:
        self.embedded_gcs = embedded_gcs
        self._ask = ask or cluster_nodes
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)  # notified at every answer
        self._nodes: tuple[Node, ...] = ()
        self._answered_at: float | None = None
        self._error = "Ray has not answered yet"
        self._listeners: list[Callable[[str], None]] = []
        self._lost: str | None = None
        self._probes = Periodic("bnrecal-ray-probe", PROBE_INTERVAL_S, self._probe_tick,
                                "probing the Ray cluster failed", log)
        self._watchdog = Periodic("bnrecal-ray-watchdog", PROBE_INTERVAL_S / 2, self._watch_tick,
                                  "watching the embedded Ray instance failed", log)

    def start(self) -> None:
        """Ask once now (so a server is ready as soon as it starts), then keep asking in the background."""
        self._probe_once()
        self._probes.start()
        self._watchdog.start()

    def stop(self) -> None:
        """Stop probing (a call in flight is left to end on its own)."""
        self._probes.stop(timeout=None)
        self._watchdog.stop(timeout=None)

    def on_lost(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` once if the embedded instance dies."""
        self._listeners.append(listener)

    @property
    def lost(self) -> str | None:
        """Why the embedded instance is gone for good, or None."""
        return self._lost or self._gcs_exit()

    def state(self) -> ClusterState:
        """The cluster as last seen, without asking it: unreachable when the embedded GCS has
        exited or the last answer is older than ``STALE_AFTER_S``."""
        lost = self.lost
        if lost is not None:
            return ClusterState(False, lost)
        with self._lock:
            answered_at, nodes, error = self._answered_at, self._nodes, self._error
        if answered_at is None:
            return ClusterState(False, error)
        age = time.monotonic() - answered_at
        if age > STALE_AFTER_S:
            return ClusterState(False, f"the Ray cluster has not answered for {age:.1f} s ({error})")
        if not nodes:
            return ClusterState(False, "the Ray cluster has no live node")
        return ClusterState(True, "", nodes)

    def require(self, wait_s: float = 1.0) -> ClusterState:
        """The state if the cluster is reachable; else a ``ServiceUnavailableError`` (503 with
        ``Retry-After``) saying why, for a submission that could not run now. An answer that is
        only late (a busy machine) is waited for up to ``wait_s``, so a submission is never
        refused for a probe that was merely slow, and never waits longer than that."""
        state = self.state()
        if not state.reachable and self.lost is None and wait_s > 0:
            with self._answered:
                self._answered.wait(wait_s)
            state = self.state()
        if not state.reachable:
            raise ServiceUnavailableError(
                f"the Ray cluster is unreachable ({state.reason}): no new jobs now; retry in a moment"
            )
        return state

    def _gcs_exit(self) -> str | None:
        gcs = self.embedded_gcs
        code = gcs.poll() if gcs is not None else None
        if code is None:
            return None
        return f"the embedded Ray instance's GCS process exited (code {code}); the server must be restarted"

    def _probe_once(self) -> None:
        try:
            if not ray.is_initialized():
                raise RuntimeError("Ray is not initialised")
            nodes = tuple(self._ask())
        except Exception as exc:  # noqa: BLE001 - any failure means unreachable, with the reason
            with self._lock:
                self._error = f"{type(exc).__name__}: {str(exc)[:200]}"
            return
        with self._answered:
            self._nodes, self._answered_at, self._error = nodes, time.monotonic(), "no answer"
            self._answered.notify_all()

    def _probe_tick(self) -> bool:
        if self.lost is not None:
            return False  # nothing will answer again; asking would only block this thread
        self._probe_once()  # may block for as long as Ray does: the answer's age tells
        return True

    def _watch_tick(self) -> bool:
        reason = self._gcs_exit()
        if reason is None:
            return True
        self._lost = reason
        log.error("%s: /readyz answers 503, submissions are refused, running jobs fail", reason)
        for listener in self._listeners:
            try:
                listener(reason)
            except Exception:  # noqa: BLE001 - every listener gets its turn
                log.exception("handling the loss of the Ray instance failed")
        return False
