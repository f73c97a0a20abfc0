"""The parts of a running service and their start-up and shut-down order.

Start-up makes the ledger the source of truth again before anything runs: uploads a
crash left half written are dropped, jobs it left ``running`` are queued again (once)
or failed with "interrupted by restart", and only then is Ray joined (or an embedded
instance started) and the runner let loose on the queue.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import ray

from .blobs import BlobStore
from .cluster import ensure_ray
from .events import ChangeFeed
from .ledger import Ledger, sqlite_url
from .metrics import ServiceMetrics
from .runner import JobRunner
from .settings import Settings

log = logging.getLogger("bnrecal.server")

PUBLIC_TENANT = "public"
"""The one tenant of a server without API keys."""


def tenant_of_key(api_key: str) -> str:
    """The tenant id of an API key: a digest, so the key itself is stored nowhere."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


@dataclass
class Services:
    """What the routes use: settings, ledger, blob store, runner, metrics and the change feed."""

    settings: Settings
    ledger: Ledger
    blobs: BlobStore
    runner: JobRunner
    metrics: ServiceMetrics
    feed: ChangeFeed
    started_ray: bool = False

    def close(self) -> None:
        """Interrupt running jobs (they go back to the queue), then release the database and Ray."""
        self.runner.stop()
        self.ledger.close()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


def open_services(settings: Settings) -> Services:
    """Recover the ledger after a possible crash, connect to Ray and start the runner."""
    data_dir = Path(settings.data_dir).absolute()
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = settings.model_copy(update={"data_dir": data_dir})
    ledger = Ledger(settings.database_url or sqlite_url(data_dir))
    blobs = BlobStore(data_dir / "blobs")
    blobs.clear_staging()
    shutil.rmtree(data_dir / "work", ignore_errors=True)  # interrupted jobs restart from scratch
    for job_id, outcome in ledger.recover_interrupted(settings.rerun_interrupted).items():
        log.warning("job %s was interrupted by a restart: now %s", job_id, outcome.value)
    try:
        started_ray = ensure_ray(settings.ray_address, min_cpus=settings.embedded_cpus or 0)
    except BaseException:
        ledger.close()
        raise
    metrics = ServiceMetrics(ledger.count_by_status)
    feed = ChangeFeed()
    runner = JobRunner(settings, ledger, blobs, metrics, feed)
    runner.start()
    return Services(settings, ledger, blobs, runner, metrics, feed, started_ray)
