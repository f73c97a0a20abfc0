"""The parts of a running service and their start-up and shut-down order.

Start-up makes the ledger the source of truth again before anything runs: uploads a
crash left half written are dropped, jobs it left ``running`` are queued again (once)
or failed with "interrupted by restart" (with a ledger shared by replicas, only those
whose lease ran out: ``service/jobserver/jobs/leases.py``), and only then is Ray joined (or an embedded
instance started) and the runner let loose on the queue.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import ray

from bnrecal.workers.data.formats.archive import mark_collected_root
from bnrecal.errors import (
    CheckpointError,
    ConflictError,
    DatasetError,
    NotFoundError,
    PayloadTooLargeError,
    ProgramError,
    QuotaExceededError,
    ServiceUnavailableError,
)

from bnrecal.service.run.cluster import embedded_gcs_process, ensure_ray, kill_embedded_processes, shutdown_embedded

from bnrecal.service.settings import Settings
from bnrecal.service.jobserver.storage.blobs import BlobInfo, BlobStore, open_blob_store
from bnrecal.service.jobserver.cluster.health import ClusterHealth
from bnrecal.service.jobserver.disk import check_reserve
from bnrecal.service.jobserver.jobs.events import ChangeFeed
from bnrecal.service.jobserver.cluster.job_host import JobHostClient
from bnrecal.service.jobserver.records.record import JobRecord
from bnrecal.service.jobserver.records.spec import (
    ARTIFACT_NAMES, SWEEP_ARTIFACT_NAMES, JobSpec, is_artifact_name, spec_digests,
)
from bnrecal.service.jobserver.jobs.submission import check_submission
from bnrecal.service.jobserver.records.views import JobView
from bnrecal.service.jobserver.ledger import Ledger, sqlite_url
from bnrecal.service.jobserver.ledger.engines import is_postgres
from bnrecal.service.jobserver.jobs.ledger_watch import LedgerWatcher
from bnrecal.service.jobserver.metrics import ServiceMetrics
from bnrecal.service.jobserver.problems import fault_field
from bnrecal.service.jobserver.jobs.runner import JobRunner
from bnrecal.service.jobserver.storage.scrub import BlobScrubber
from bnrecal.service.jobserver.storage.collection import StorageCollector

log = logging.getLogger("bnrecal.server")

HOST_START_TIMEOUT_S = 120.0
"""Longest start-up waits for the job host (a process importing torch) before serving anyway."""

RAY_SHUTDOWN_S = 1.5
"""Longest a stopping server waits on Ray's shutdown when the cluster does not answer."""

POOL_CLOSE_S = 15.0
"""Longest a stopping server waits for its warm pool to close (the job host's own limit is 10 s)."""

RUNNER_STOP_S = 30.0
"""Longest a stopping server waits for its interrupted jobs' threads while the cluster answers."""

LOST_CLUSTER_EXIT_S = 5.0
"""After its embedded Ray instance died, how long the server still answers (503s, reads)
before it stops itself."""

PUBLIC_TENANT = "public"
"""The one tenant of a server without API keys."""


def _cell_prefix(name: str) -> str:
    """``<model>-<set>-`` for a sweep's cell's artifact (its download's file name says whose), else nothing."""
    return name.rsplit("/", 1)[0].replace("/", "-") + "-" if "/" in name else ""


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
    collector: StorageCollector | None = None
    pool: JobHostClient | None = None  # the job host, where the jobs run and the warm rank actors live
    watcher: LedgerWatcher | None = None  # other replicas' changes, when the ledger is shared
    scrubber: BlobScrubber | None = None  # re-hashes the stored blobs on a schedule
    health: ClusterHealth | None = None  # the cluster as last seen, never asked on a request (None: ask Ray)
    draining: threading.Event = field(default_factory=threading.Event)

    def check_accepting(self) -> None:
        """Refuse new work (503) once a shutdown has begun; reads, downloads and cancels go on."""
        if self.draining.is_set():
            raise ServiceUnavailableError(
                "the server is shutting down and takes no new uploads or jobs; retry in a moment "
                "(its replacement, or this server after its restart, will take them)"
            )

    def drain(self) -> list[str]:
        """Shut down gently: take no new uploads or jobs, let running jobs finish within
        ``BNRECAL_SHUTDOWN_GRACE_S``, then put the rest back in the queue (their attempt not
        counted) and end the event streams; returns the ids put back."""
        self.draining.set()
        grace = self.settings.shutdown_grace_s if self._reachable() else 0.0  # nothing can finish without the cluster
        running = self.runner.running_jobs()
        if running:
            log.warning("shutting down: waiting up to %g s for %d running job(s)", grace, len(running))
        left = self.runner.drain(grace, self._unreachable)
        if left:
            log.warning("shutdown grace of %g s is over: %d job(s) go back to the queue: %s (BNRECAL_SHUTDOWN_GRACE_S)",
                        grace, len(left), ", ".join(left))
        self._stop_runner()
        self.feed.close()
        return left

    def cluster_lost(self, reason: str) -> None:
        """The embedded Ray instance died for good: fail the running jobs with the reason, then
        stop the server (SIGTERM to itself: new work is refused meanwhile, and the instance's
        remaining processes are stopped with it), so that its supervisor starts it afresh. When
        the server is stopping already, the instance went with it (a signal to the whole process
        group): its running jobs go back to the queue, as a shutdown leaves them."""
        if self.draining.is_set():
            self.runner.requeue_running()
        else:
            self.runner.fail_running(reason)
        log.error("stopping the server in %g s: %s", LOST_CLUSTER_EXIT_S, reason)
        timer = threading.Timer(LOST_CLUSTER_EXIT_S, os.kill, args=(os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()

    def _stop_runner(self) -> None:
        """Interrupt the running jobs (back to the queue), waiting for their threads a while with
        a cluster that answers, not once it stops answering (they may be stuck in a Ray call
        that never returns: the runner queues their jobs again itself)."""
        self.runner.stop(RUNNER_STOP_S, self._unreachable)

    def _reachable(self) -> bool:
        return self.health is None or self.health.state().reachable

    def _unreachable(self) -> bool:
        return not self._reachable()

    def _close_pool(self) -> bool:
        """Close the warm pool, waiting no longer once the cluster stops answering the health
        probe (a SIGTERM sent to the whole process group ends the embedded GCS as this server
        stops, and a Ray call then blocks for a minute), nor past ``POOL_CLOSE_S``; whether it closed."""
        assert self.pool is not None
        closed = returned_within(self.pool.close, POOL_CLOSE_S, "bnrecal-pool-close", self._unreachable)
        if not closed:
            log.warning("the warm pool was not closed: the Ray cluster stopped answering")
        return closed

    async def upload(
        self, tenant: str, chunks: AsyncIterator[bytes], declared_size: int | None, filename: str | None = None
    ) -> BlobInfo:
        """Store an upload within ``BNRECAL_MAX_UPLOAD_BYTES`` and the tenant's room under
        ``BNRECAL_TENANT_QUOTA_BYTES`` (refused early when its declared size is already over),
        counting it in the metrics; ``filename`` is kept for messages."""
        self.check_accepting()
        cap = self.settings.max_upload_bytes
        try:
            if declared_size is not None and declared_size > cap:
                raise PayloadTooLargeError(
                    f"upload of {declared_size} bytes exceeds the limit of {cap} bytes (BNRECAL_MAX_UPLOAD_BYTES)"
                )
            room, over_quota = await anyio.to_thread.run_sync(self._quota_room, tenant)
            if room is None:
                info = await self.blobs.ingest(tenant, chunks, cap, filename)
            elif declared_size is not None and declared_size > room:
                raise over_quota(declared_size)
            else:
                over_limit = over_quota if room < cap else None
                info = await self.blobs.ingest(tenant, chunks, min(cap, room), filename, over_limit)
        except PayloadTooLargeError:
            self.metrics.uploads_rejected.inc()
            raise
        self.metrics.upload_bytes.inc(info.size)
        return info

    def _quota_room(self, tenant: str) -> tuple[int | None, Callable[[int], QuotaExceededError]]:
        """Bytes the tenant may still store under ``BNRECAL_TENANT_QUOTA_BYTES`` (None: no quota),
        and the error for an upload past them."""
        quota = self.settings.tenant_quota_bytes
        used = self.collector.usage(tenant) if quota is not None and self.collector is not None else 0

        def over_quota(size: int) -> QuotaExceededError:
            return QuotaExceededError(
                f"upload would exceed this API key's storage quota: {used} bytes stored + {size} bytes of this "
                f"upload > {quota} bytes (BNRECAL_TENANT_QUOTA_BYTES); delete jobs or blobs you no longer need"
            )

        return (max(0, quota - used) if quota is not None else None), over_quota

    def view(self, job: JobRecord) -> JobView:
        """The job resource, its input blobs named with the file names they were uploaded with."""
        digests = job.input_digests().values()
        return job.view({digest: self.blobs.filename(job.tenant, digest) for digest in digests})

    def check(self, tenant: str, spec: JobSpec) -> JobSpec:
        """A dry run of :meth:`submit`: every check a submission gets, nothing created or queued;
        the spec as it would be stored (every default filled in)."""
        self.check_accepting()
        spec = spec.with_outputs()
        self._check_submission(tenant, spec)
        return spec

    def _check_submission(self, tenant: str, spec: JobSpec) -> None:
        """:func:`check_submission`; when it refuses a blob the spec names (a checkpoint that
        does not read), that blob is hashed first: a damaged blob is refused as corrupt (and
        quarantined), not as a bad file the user sent."""
        try:
            nodes = list(self.health.require().nodes) if self.health is not None else None
            check_submission(spec, tenant, self.blobs, self.settings, nodes)
        except (CheckpointError, ProgramError, DatasetError) as exc:  # a file that does not read (not a bad shape)
            field = fault_field(exc, spec)
            digest = spec.input_sources().get(field) if isinstance(field, str) else None
            if isinstance(digest, str) and self.blobs.exists(tenant, digest):
                self.blobs.check(tenant, digest, field=field, where="submission")  # raises if corrupt
            raise

    def submit(self, tenant: str, spec: JobSpec, idempotency_key: str | None) -> tuple[JobRecord, bool]:
        """Check a job spec against the tenant's blobs, the settings and the cluster, and queue
        it within the tenant's ``BNRECAL_TENANT_MAX_QUEUED_JOBS`` (else 429); with an idempotency
        key already used, the job it made (``created`` is then false)."""
        self.check_accepting()
        check_reserve(Path(self.settings.data_dir), self.settings.min_free_bytes)  # 507 before anything is written
        spec = spec.with_outputs()
        stored = spec.model_dump(mode="json")
        for digest in spec_digests(stored).values():
            self.blobs.touch(tenant, digest)  # used now: the collector keeps it a full retention period
        self._check_submission(tenant, spec)
        job, created = self.ledger.create(tenant, stored, idempotency_key, self.settings.tenant_max_queued_jobs)
        if created:
            self.feed.publish(job.id)  # the tenant's change streams show it at once
            self.runner.wake()
        return job, created

    def cancel(self, tenant: str, job_id: str) -> JobRecord:
        """Cancel a job: a queued one at once, a running one as soon as its actors are stopped."""
        job = self.ledger.request_cancel(tenant, job_id)
        self.runner.cancel(job_id)
        self.feed.publish(job_id)
        return job

    def artifact(self, tenant: str, job_id: str, name: str) -> ArtifactFile:
        """Where a job's artifact is: 404 for an unknown name or one the job did not make, 409
        while the job has not finished, unless it is a sweep's cell that has (docs/sweeps.md)."""
        job = self.ledger.get(tenant, job_id)
        if not is_artifact_name(name):
            raise NotFoundError(
                f"no artifact {name!r}: artifacts are {', '.join(ARTIFACT_NAMES)}; a sweep's are "
                f"{', '.join(SWEEP_ARTIFACT_NAMES)} and <model>/<set>/<artifact> for each cell"
            )
        artifact = job.artifacts.get(name)
        if not job.status.is_terminal and artifact is None:
            raise ConflictError(f"job {job_id} is {job.status.value}; its artifacts exist once it has succeeded")
        if artifact is None:
            raise NotFoundError(f"job {job_id} ({job.status.value}) has no {name} artifact")
        return ArtifactFile(
            path=self.blobs.path(tenant, artifact.digest),
            digest=artifact.digest,
            media_type=artifact.media_type,
            filename=f"{job_id[:12]}-{_cell_prefix(name)}{artifact.filename}",
        )

    def delete_job(self, tenant: str, job_id: str) -> int:
        """Delete a finished job and free its artifacts no other job references (409 while it is
        queued or running); the bytes freed."""
        assert self.collector is not None
        freed = self.collector.delete_job(tenant, job_id)
        self.feed.publish_removed(tenant, job_id)
        return freed

    def delete_blob(self, tenant: str, digest: str) -> int:
        """Delete a blob (409 while a queued or running job uses it); the bytes freed."""
        assert self.collector is not None
        return self.collector.delete_blob(tenant, digest)

    def close(self) -> None:
        """Interrupt running jobs (they go back to the queue), then release the database and Ray.

        Bounded whatever Ray's state (docs/api.md, "Restarts"): with the cluster unreachable
        nothing waits on a Ray call, and an embedded instance is stopped outright, its agents
        and workers with it. If Ray's own shutdown still hangs, the process ends without it."""
        reachable = self._reachable()
        if self.collector is not None:
            self.collector.stop(2.0)
        if self.scrubber is not None:
            self.scrubber.stop(2.0)
        if self.watcher is not None:
            self.watcher.stop()
        self._stop_runner()
        if self.pool is not None and reachable:  # after the runner: no job runs there any more
            reachable = self._close_pool()
        if self.health is not None:
            self.health.stop()
        self.ledger.close()
        if not ray.is_initialized() or not self.started_ray:
            return  # a cluster this server joined is not its to stop (nor is its host process to end)
        lost = self.health is not None and self.health.lost is not None
        if reachable and not lost:
            shutdown_embedded()  # its idle autoscaler killed first: Ray's shutdown gives it a second to ignore SIGTERM
            return
        gone = (lambda: self.health.lost is not None) if self.health is not None else (lambda: False)
        if not lost and shutdown_within(RAY_SHUTDOWN_S, gone):
            return  # a late probe on a busy machine is not a dead instance: Ray's own shutdown, bounded
        # dead for good (or its shutdown hangs): its processes are killed, Ray's shutdown would wait on them
        kill_embedded_processes()
        log.error("stopped with the embedded Ray instance gone: exiting without Ray's shutdown")
        _exit_now(1)


def shutdown_within(timeout_s: float, give_up: Callable[[], bool] = lambda: False) -> bool:
    """``ray.shutdown`` in a thread of its own; whether it returned within ``timeout_s``
    (and before ``give_up()``, checked every 0.1 s: the instance's GCS exited meanwhile)."""

    def shutdown() -> None:
        from ray._private import auto_init_hook

        auto_init_hook.enable_auto_connect = False  # a job thread's late call must not reconnect
        ray.shutdown()

    return returned_within(shutdown, timeout_s, "bnrecal-ray-shutdown", give_up)


def returned_within(call: Callable[[], Any], timeout_s: float, name: str,
                    give_up: Callable[[], bool] = lambda: False) -> bool:
    """Run ``call`` in a daemon thread; whether it returned within ``timeout_s`` (checking
    ``give_up`` every 0.1 s meanwhile). A Ray call on a dead cluster is left to block there."""
    done = threading.Event()

    def run() -> None:
        try:
            call()
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
        if give_up() or time.monotonic() >= deadline:
            return False
    return True


def _exit_now(code: int) -> None:
    """End the process at once (Ray's exit handler would wait on its dead instance again)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)


def open_services(settings: Settings) -> Services:
    """Recover the ledger after a possible crash, connect to Ray and start the runner."""
    data_dir = Path(settings.data_dir).absolute()
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = settings.model_copy(update={"data_dir": data_dir})
    ledger = Ledger(settings.database_url or sqlite_url(data_dir))
    blobs = open_blob_store(settings.blob_store, data_dir / "blobs", settings.s3_endpoint_url)
    blobs.clear_staging()
    mark_collected_root(settings.data_access().unpack_root)  # failed jobs' unpacks go via the collector
    shutil.rmtree(data_dir / "work", ignore_errors=True)  # interrupted jobs restart from scratch
    shared = is_postgres(ledger.engine)  # other replicas may be running jobs: only expired leases are ours to recover
    expired_before = datetime.now(UTC) if shared else None
    for job_id, outcome in ledger.recover_interrupted(settings.rerun_interrupted, expired_before).items():
        log.warning("job %s was interrupted by a restart: now %s", job_id, outcome.value)
    try:
        started_ray = ensure_ray(settings.ray_address, min_cpus=settings.embedded_cpus or 0)
    except BaseException:
        ledger.close()
        raise
    health = ClusterHealth(embedded_gcs_process() if started_ray else None)
    health.start()
    metrics = ServiceMetrics(ledger.count_by_status)
    blobs.on_corrupt = metrics.count_corrupt
    feed = ChangeFeed()
    host = JobHostClient(settings.warm_pool_idle_s)
    host.wait_ready(HOST_START_TIMEOUT_S)  # on this process's Ray node; ready before the first job
    runner = JobRunner(settings, ledger, blobs, metrics, feed, host, health=health)
    runner.start()
    collector = StorageCollector(settings, ledger, blobs)
    collector.start()
    scrubber = BlobScrubber(settings, ledger, blobs, metrics)
    scrubber.start()
    watcher = LedgerWatcher(ledger, feed, settings.ledger_poll_s) if shared else None
    if watcher is not None:
        watcher.start()
    services = Services(settings, ledger, blobs, runner, metrics, feed, started_ray, collector, host, watcher, scrubber,
                        health=health)
    health.on_lost(services.cluster_lost)
    return services

