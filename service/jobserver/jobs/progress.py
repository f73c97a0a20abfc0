"""A running job's progress and phases as the job host reports them, written to the ledger
and told to the job's event streams: metrics at once, the ledger a few times a second. On a
full disk the job goes on without what did not fit (its outcome says so, docs/storage.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from bnrecal.errors import InsufficientStorageError

from bnrecal.service.run.options import STARTING_PHASE

from bnrecal.service.jobserver.jobs.events import ChangeFeed
from bnrecal.service.jobserver.cluster.hosted_work import CellDone, Event
from bnrecal.service.jobserver.ledger import Ledger
from bnrecal.service.jobserver.metrics import ServiceMetrics

log = logging.getLogger("bnrecal.runner")

PROGRESS_INTERVAL_S = 0.25  # at most this often a job's progress is written to the ledger


class JobProgress:
    """The progress writer of one running job."""

    def __init__(
        self, job_id: str, ledger: Ledger, feed: ChangeFeed, metrics: ServiceMetrics,
        on_cell: Callable[[CellDone], None] | None = None,
    ) -> None:
        self.job_id = job_id
        self.on_cell = on_cell
        self.ledger = ledger
        self.feed = feed
        self.metrics = metrics
        self._done = 0
        self._calibrating = "calibrating"
        self._written = 0.0
        self._phase: str | None = None

    def on_events(self, events: list[Event]) -> None:
        """The host's events since the last call: (done, total, phase), (None, None, phase)
        for a phase that counts no samples, or a sweep's finished cell (``on_cell``)."""
        for event in events:
            if isinstance(event, CellDone):
                if self.on_cell is not None:
                    self.on_cell(event)
                continue
            done, total, phase = event
            if done is None or total is None:
                self.enter_phase(phase)
            else:
                self.progress(done, total, phase)

    def progress(self, done: int, total: int, phase: str) -> None:
        """Samples done of ``total`` in ``phase``: written at a phase's change, at its end, and
        at most every ``PROGRESS_INTERVAL_S`` in between."""
        if self._phase is None and phase == STARTING_PHASE:
            self._phase = phase  # the ledger entered it as the job started: one event per phase
            return
        if phase.rsplit("] ", 1)[-1] == "calibrating":  # a sweep's cell's too ("[2/8 m/s] calibrating")
            if phase != self._calibrating:  # a new cell counts from 0
                self._calibrating, self._done = phase, 0
            self.metrics.samples_processed.inc(max(0, done - self._done))
            self._done = done
        now = time.monotonic()
        if done >= total or phase != self._phase or now - self._written >= PROGRESS_INTERVAL_S:
            self._written, self._phase = now, phase
            try:
                self.ledger.set_progress(self.job_id, done, total, phase)
            except InsufficientStorageError:  # the job goes on: its outcome says what did not fit
                log.warning("job %s: the disk is full; its progress was not written", self.job_id)
                return
            self.feed.publish(self.job_id)

    def enter_phase(self, phase: str) -> None:
        """Tell the ledger and the job's listeners that the job moved on to ``phase``."""
        try:
            self.ledger.set_phase(self.job_id, phase)
        except InsufficientStorageError:
            log.warning("job %s: the disk is full; its phase %r was not written", self.job_id, phase)
            return
        self.feed.publish(self.job_id)
