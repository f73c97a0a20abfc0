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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import ray

from workers.errors import NotFoundError, PayloadTooLargeError
from workers.pool import WarmPool

from .blobs import BlobInfo, BlobStore
from .cluster import ensure_ray
from .events import ChangeFeed
from .jobs import ARTIFACT_NAMES, ConflictError, JobRecord, JobSpec, check_submission
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


@dataclass(frozen=True)
class ArtifactFile:
    """A job artifact as a download: the stored file, its digest, type and file name."""

    path: Path
    digest: str
    media_type: str
    filename: str


@dataclass
class Services:
    """The running service: its parts (settings, ledger, blob store, runner, metrics, change
    feed) and the operations the HTTP routes call, so the routes keep no rules of their own."""

    settings: Settings
    ledger: Ledger
    blobs: BlobStore
    runner: JobRunner
    metrics: ServiceMetrics
    feed: ChangeFeed
    started_ray: bool = False
    pool: WarmPool | None = None

    async def upload(
        self, tenant: str, chunks: AsyncIterator[bytes], declared_size: int | None, filename: str | None = None
    ) -> BlobInfo:
        """Store an upload within ``BNRECAL_MAX_UPLOAD_BYTES`` (refused early when its declared
        size is already over), counting it in the metrics; ``filename`` is kept for messages."""
        cap = self.settings.max_upload_bytes
        try:
            if declared_size is not None and declared_size > cap:
                raise PayloadTooLargeError(
                    f"upload of {declared_size} bytes exceeds the limit of {cap} bytes (BNRECAL_MAX_UPLOAD_BYTES)"
                )
            info = await self.blobs.ingest(tenant, chunks, cap, filename)
        except PayloadTooLargeError:
            self.metrics.uploads_rejected.inc()
            raise
        self.metrics.upload_bytes.inc(info.size)
        return info

    def submit(self, tenant: str, spec: JobSpec, idempotency_key: str | None) -> tuple[JobRecord, bool]:
        """Check a job spec against the tenant's blobs and the settings, and queue it; with
        an idempotency key already used, the job it made (``created`` is then false)."""
        check_submission(spec, tenant, self.blobs, self.settings)
        job, created = self.ledger.create(tenant, spec.model_dump(mode="json"), idempotency_key)
        if created:
            self.runner.wake()
        return job, created

    def cancel(self, tenant: str, job_id: str) -> JobRecord:
        """Cancel a job: a queued one at once, a running one as soon as its actors are stopped."""
        job = self.ledger.request_cancel(tenant, job_id)
        self.runner.cancel(job_id)
        self.feed.publish(job_id)
        return job

    def artifact(self, tenant: str, job_id: str, name: str) -> ArtifactFile:
        """Where a finished job's artifact is: 404 for an unknown name or one the job did not
        make, 409 while the job has not finished."""
        job = self.ledger.get(tenant, job_id)
        if name not in ARTIFACT_NAMES:
            raise NotFoundError(f"no artifact {name!r}: artifacts are {', '.join(ARTIFACT_NAMES)}")
        if not job.status.is_terminal:
            raise ConflictError(f"job {job_id} is {job.status.value}; its artifacts exist once it has succeeded")
        artifact = job.artifacts.get(name)
        if artifact is None:
            raise NotFoundError(f"job {job_id} ({job.status.value}) has no {name} artifact")
        return ArtifactFile(
            path=self.blobs.path(tenant, artifact["digest"]),
            digest=artifact["digest"],
            media_type=artifact["media_type"],
            filename=f"{job_id[:12]}-{artifact['filename']}",
        )

    def close(self) -> None:
        """Interrupt running jobs (they go back to the queue), then release the database and Ray."""
        self.runner.stop()
        if self.pool is not None:  # after the runner: no job takes or returns warm actors any more
            self.pool.close()
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
    pool = WarmPool(settings.warm_pool_idle_s)
    runner = JobRunner(settings, ledger, blobs, metrics, feed, pool=pool)
    runner.start()
    return Services(settings, ledger, blobs, runner, metrics, feed, started_ray, pool=pool)
