"""Changes made by other replicas, brought to this replica's event streams.

The change feed (``service/jobserver/jobs/events.py``) hears only this process's runner. When replicas
share a Postgres ledger, a job followed here may run on another replica, so a watcher
thread polls the ledger every ``BNRECAL_LEDGER_POLL_S`` for the revisions of the jobs that
are queued or running or ended a moment ago, and publishes each job whose revision moved:
its streams then read the job from the ledger as usual.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from sqlalchemy import or_, select

from bnrecal.service.jobserver.jobs.events import ChangeFeed
from bnrecal.service.jobserver.records.views import JobStatus
from bnrecal.service.jobserver.ledger import JobRow, Ledger
from bnrecal.service.jobserver.periodic import Periodic

log = logging.getLogger("bnrecal.ledger_watch")

RECENTLY_ENDED_S = 60.0  # a job that ended this long ago is still watched, so no poll misses its end


class LedgerWatcher:
    """Publishes to ``feed`` every job another process changed, polling the ledger."""

    def __init__(self, ledger: Ledger, feed: ChangeFeed, interval_s: float) -> None:
        self.ledger = ledger
        self.feed = feed
        self.interval_s = interval_s
        self._seen: dict[str, int] = {}
        self._periodic = Periodic("bnrecal-ledger-watch", interval_s, self.poll,
                                  "polling the ledger for other replicas' changes failed", log)

    def start(self) -> None:
        """Poll in a daemon thread until :meth:`stop`."""
        self._periodic.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop polling."""
        self._periodic.stop(timeout)

    def poll(self) -> list[str]:
        """One look at the ledger: publish (and return) the ids of the jobs whose revision changed."""
        recent = datetime.now(UTC) - timedelta(seconds=RECENTLY_ENDED_S)
        live = [JobStatus.queued.value, JobStatus.running.value]
        query = select(JobRow.id, JobRow.revision).where(
            or_(JobRow.status.in_(live), JobRow.finished_at >= recent)
        )
        with self.ledger.engine.connect() as connection:
            revisions = {job_id: revision for job_id, revision in connection.execute(query)}
        changed = [job_id for job_id, revision in revisions.items() if self._seen.get(job_id) != revision]
        self._seen = revisions
        for job_id in changed:
            self.feed.publish(job_id)
        return changed
