"""The job runner: the queue drained onto Ray within the cluster's resources, fairly.

One dispatcher thread starts queued jobs while their ranks' CPUs (and GPUs) fit in what
the cluster has and running jobs do not already hold. Tenants (API keys) take turns: the
next job is the oldest queued job of the tenant served longest ago, so one tenant's
backlog delays another's job by at most the jobs already running, and a tenant at
``BNRECAL_TENANT_MAX_RUNNING_JOBS`` is skipped while others go on. Within a tenant jobs
start oldest first. (A job too big for the cluster, accepted with
``BNRECAL_CAPACITY_CHECK`` off, still runs when it is alone, to fail with Ray's placement
error rather than wait forever.) Each job has a thread here that runs it on the job host
(:mod:`service.jobserver.cluster.job_host`: :func:`recalibrate`, the export and the files, off the API
process), passes the progress it collects from there a few times a second to the ledger
and the event streams, forwards a cancel (the host kills the job's actors and frees their
placement group), and stores the files the host wrote as the tenant's blobs.

Replicas sharing one ledger run each job once: a job is claimed under a lease that a
keeper thread renews while it runs, and taken over by any replica once a dead replica's
lease runs out (``service/jobserver/jobs/leases.py``).
"""

from __future__ import annotations

import itertools
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from bnrecal.errors import (
    BnrecalError,
    CancelledError,
    InputError,
    InsufficientStorageError,
    NotFoundError,
    RunError,
    first_line,
)

from bnrecal.service.run.recalibrate import RecalibrationRequest, rank_resources

from bnrecal.service.settings import Settings
from bnrecal.service.jobserver.storage.blobs import BlobInfo, BlobStore
from bnrecal.service.jobserver.cluster.health import ClusterHealth
from bnrecal.service.jobserver.disk import check_reserve, disk_full_error
from bnrecal.service.jobserver.jobs.events import ChangeFeed
from bnrecal.service.jobserver.cluster.job_host import JobHostClient
from bnrecal.service.jobserver.jobs.leases import JobLeases, replica_id
from bnrecal.service.jobserver.jobs.progress import JobProgress
from bnrecal.service.run.report.page import JobLabel
from bnrecal.service.jobserver.jobs.inputs import job_request, sweep_files
from bnrecal.service.jobserver.cluster.hosted_work import CellDone, sweep_rank_by
from bnrecal.service.sweep.matrix import SweepReport
from bnrecal.service.sweep.cells import SweepFiles
from bnrecal.service.jobserver.records.record import JobRecord
from bnrecal.service.jobserver.records.spec import JobSpec
from bnrecal.service.jobserver.records.views import Artifact, JobStatus
from bnrecal.service.jobserver.ledger import Ledger
from bnrecal.service.jobserver.metrics import ServiceMetrics
from bnrecal.service.jobserver.problems import problem_of

log = logging.getLogger("bnrecal.runner")

@dataclass
class _Running:
    """A job in flight: its thread, its cancel switch and the resources it holds."""

    cancel: threading.Event
    cpus: float
    gpus: float
    shutdown: bool = False
    lost: bool = False  # another replica took the job over: nothing of this run is written
    thread: threading.Thread | None = field(default=None, repr=False)


class JobRunner:
    """Runs the ledger's queued jobs, at most as many at once as the cluster holds."""

    def __init__(
        self,
        settings: Settings,
        ledger: Ledger,
        blobs: BlobStore,
        metrics: ServiceMetrics,
        feed: ChangeFeed,
        host: JobHostClient,
        leases: JobLeases | None = None,
        health: ClusterHealth | None = None,
    ) -> None:
        self.settings = settings
        self.health = health  # the cluster as last seen: dispatching never waits on a Ray that hangs
        self.leases = leases or JobLeases(ledger, replica_id(), settings.job_lease_s)
        self.host = host  # the actor that runs the jobs' driver work, and owns the warm rank actors
        self.ledger = ledger
        self.blobs = blobs
        self.metrics = metrics
        self.feed = feed
        self._lock = threading.Lock()
        self._running: dict[str, _Running] = {}
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._dispatcher: threading.Thread | None = None
        self._turns = itertools.count(1)
        self._served: dict[str, int] = {}  # tenant -> the turn its latest job started in (round robin)

    def start(self) -> None:
        """Start draining the queue (Ray must be initialised)."""
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="bnrecal-dispatcher", daemon=True)
        self._dispatcher.start()
        threading.Thread(target=self._lease_loop, name="bnrecal-leases", daemon=True).start()
        self.wake()

    def wake(self) -> None:
        """Look at the queue now (a job was queued, finished or cancelled)."""
        self._wakeup.set()

    def cancel(self, job_id: str) -> None:
        """Stop a running job: its actors are killed and it ends ``cancelled``."""
        with self._lock:
            entry = self._running.get(job_id)
        if entry is not None:
            entry.cancel.set()
        self.wake()

    def running_jobs(self) -> list[str]:
        """Ids of the jobs running now (not those already failed for a lost cluster, or taken over)."""
        with self._lock:
            return [job_id for job_id, entry in self._running.items() if not entry.lost]

    def drain(self, grace_s: float, give_up: Callable[[], bool] = lambda: False) -> list[str]:
        """Start no more jobs and give the running ones up to ``grace_s`` seconds to finish,
        so a shutdown interrupts as little work as it can, no longer once ``give_up()`` (the
        cluster stopped answering: nothing can finish); returns the ids still running."""
        deadline = time.monotonic() + grace_s
        self._draining.set()
        while self.running_jobs() and time.monotonic() < deadline and not give_up():
            time.sleep(0.1)
        return self.running_jobs()

    def stop(self, timeout: float = 30.0, give_up: Callable[[], bool] = lambda: False) -> None:
        """Stop starting jobs and interrupt the running ones, which go back to the queue. Their
        threads get up to ``timeout`` seconds, none once ``give_up()`` (a cluster that no longer
        answers leaves them in a Ray call that never returns): the jobs of threads still
        running then are queued again from here (``requeue_running``)."""
        deadline = time.monotonic() + timeout
        self._stopping.set()
        self._wakeup.set()
        if self._dispatcher is not None:  # after this, no job starts any more
            self._dispatcher.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            entries = list(self._running.values())
        for entry in entries:
            entry.shutdown = True
            entry.cancel.set()
        for entry in entries:
            while entry.thread is not None and entry.thread.is_alive() and time.monotonic() < deadline and not give_up():
                entry.thread.join(0.1)
        self.requeue_running()

    def fail_running(self, reason: str) -> list[str]:
        """Fail every running job with ``reason`` (the cluster they ran on is gone for good).
        The ids failed (``_end_running``)."""
        problem = problem_of(RunError(f"the job could not go on: {reason}; submit it again"))
        failed = self._end_running(lambda job_id: self.leases.finish(job_id, JobStatus.failed, error=problem))
        for _ in failed:
            self.metrics.job_seconds.labels(status=JobStatus.failed.value).observe(0.0)
        if failed:
            log.error("%d running job(s) failed: %s: %s", len(failed), reason, ", ".join(failed))
        return failed

    def requeue_running(self) -> list[str]:
        """Put every job still running here back in the queue, its attempt not counted (this
        server stops, and the cluster went with it, or its jobs' threads did not end in time):
        they run again after the restart. The ids queued again (``_end_running``)."""
        queued = self._end_running(self.leases.requeue)
        if queued:
            log.warning("%d running job(s) go back to the queue: %s", len(queued), ", ".join(queued))
        return queued

    def _end_running(self, write: Callable[[str], bool]) -> list[str]:
        """End every running job by ``write(job_id)`` from this thread, at once: their own threads
        may be stuck in a Ray call that never returns, and whatever they do later is not written
        (as for a job taken over). The ids written."""
        with self._lock:
            running = [(job_id, entry) for job_id, entry in self._running.items() if not entry.lost]
        written = []
        for job_id, entry in running:
            entry.lost = True
            entry.cancel.set()
            try:
                if not write(job_id):
                    continue  # ended meanwhile, or no longer this replica's
            except Exception:  # noqa: BLE001 - the others still get theirs; the lease takes it from here
                log.exception("could not write the outcome of job %s", job_id)
                continue
            self.feed.publish(job_id)
            written.append(job_id)
        return written

    def job_resources(self, spec: JobSpec) -> tuple[float, float]:
        """CPUs and GPUs a job's ranks take on the cluster (as :func:`recalibrate` will ask; a
        sweep's for every cell it runs at once)."""
        cpus, gpus = rank_resources(self.settings, spec)
        return cpus * spec.ranks, gpus * spec.ranks

    def _dispatch_loop(self) -> None:
        while not self._stopping.is_set():
            self._wakeup.wait(timeout=2.0)
            self._wakeup.clear()
            if self._stopping.is_set():
                return
            try:
                self._dispatch()
            except Exception:  # noqa: BLE001 - the dispatcher must survive a bad moment (e.g. a locked db)
                log.exception("dispatching queued jobs failed; retrying")

    def _dispatch(self) -> None:
        """Start queued jobs while they fit, taking tenants in turn (see :meth:`_next_jobs`);
        stop at the first job whose turn it is that does not fit, so a big job is not
        overtaken for ever by small ones."""
        if self.health is not None:
            state = self.health.state()
            if not state.reachable:
                return  # queued jobs wait for the cluster (the probe wakes nothing: the 2 s tick retries)
            cpus_total, gpus_total = state.cpus, state.gpus
        else:
            resources = ray.cluster_resources()
            cpus_total, gpus_total = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
        limit = self.settings.max_concurrent_jobs
        while True:
            job = next(iter(self._next_jobs()), None)
            if job is None:
                return
            try:
                spec = JobSpec.model_validate(job.spec).with_outputs()
            except ValueError as exc:
                problem = problem_of(BnrecalError(f"invalid stored spec: {exc}"))
                self.ledger.finish(job.id, JobStatus.failed, error=problem)
                continue
            cpus, gpus = self.job_resources(spec)
            with self._lock:
                if self._stopping.is_set() or self._draining.is_set():
                    return
                busy = len(self._running)
                cpus_used = sum(entry.cpus for entry in self._running.values())
                gpus_used = sum(entry.gpus for entry in self._running.values())
                fits = cpus_used + cpus <= cpus_total + 1e-9 and gpus_used + gpus <= gpus_total + 1e-9
                if busy and (not fits or (limit is not None and busy >= limit)):
                    return
                entry = _Running(threading.Event(), cpus, gpus)
                self._running[job.id] = entry
                self._served[job.tenant] = next(self._turns)
            started = self.leases.claim(job.id)
            if started is None:  # cancelled while queued, or claimed by another replica
                with self._lock:
                    self._running.pop(job.id, None)
                continue
            self.feed.publish(job.id)
            entry.thread = threading.Thread(
                target=self._execute, args=(started, spec, entry), name=f"bnrecal-job-{job.id[:8]}", daemon=True
            )
            entry.thread.start()

    def _lease_loop(self) -> None:
        """Every third of ``BNRECAL_JOB_LEASE_S``: renew the leases of this replica's running jobs
        (stopping a job cancelled on another replica, or taken over by one), and queue again the
        jobs of replicas that let theirs run out."""
        every = self.settings.job_lease_s / 3
        renewed = time.monotonic()
        while not self._stopping.wait(every):
            try:
                late = time.monotonic() - renewed
                if late > 2 * every:  # a starved process or a slow database: say so, a take-over may follow
                    log.warning(
                        "job leases renewed %.1f s apart (due every %.1f s, each lasts %.1f s): this replica was "
                        "held up, and another may take over its jobs", late, every, self.settings.job_lease_s,
                    )
                self._renew_leases()
                renewed = time.monotonic()
                taken = self.leases.take_over_expired(self.settings.rerun_interrupted)
                for job_id, outcome in taken.items():
                    log.warning("job %s: its replica let its lease run out; now %s", job_id, outcome.value)
                if taken:
                    self.wake()
            except Exception:  # noqa: BLE001 - a bad moment (the database restarting) must not end renewals
                log.exception("renewing job leases failed; retrying")

    def _renew_leases(self) -> None:
        with self._lock:
            running = list(self._running.items())
        for job_id, entry in running:
            renewal = self.leases.renew(job_id)
            if renewal.held or entry.thread is None or not entry.thread.is_alive():
                if renewal.cancel_requested:
                    entry.cancel.set()
                continue
            if not self._ended(job_id):  # not merely finished here a moment ago
                log.warning("job %s: its lease was taken over by another replica; stopping this run", job_id)
                entry.lost = True
                entry.cancel.set()

    def _ended(self, job_id: str) -> bool:
        try:
            return self.ledger.get_any(job_id).status.is_terminal
        except NotFoundError:  # finished and already deleted
            return True

    def _next_jobs(self) -> list[JobRecord]:
        """Each tenant's oldest queued job, in the order they take their turn: the tenant
        served longest ago (or never, since this server started) first, ties oldest job first.
        A tenant at ``BNRECAL_TENANT_MAX_RUNNING_JOBS`` running jobs (counted in the ledger,
        so across servers) is left out until one ends; the others go on."""
        heads = self.ledger.queue_heads()
        limit = self.settings.tenant_max_running_jobs
        if limit is not None and heads:
            running = self.ledger.count_by_tenant(JobStatus.running)
            heads = [job for job in heads if running.get(job.tenant, 0) < limit]
        with self._lock:
            return sorted(heads, key=lambda job: self._served.get(job.tenant, 0))  # stable: ties stay oldest first

    def _execute(self, job: JobRecord, spec: JobSpec, entry: _Running) -> None:
        """Run one job to a terminal status (or back to the queue on shutdown). Nothing here
        raises past the thread: an outcome the ledger cannot take is logged, and the job's
        lease, no longer renewed, runs out and queues it again (docs/storage.md)."""
        started = time.monotonic()
        workdir = Path(self.settings.data_dir) / "work" / job.id
        final = JobStatus.failed
        try:
            artifacts, report, failed = self._run(job, spec, entry.cancel, workdir)
            if failed is not None:  # a sweep with failed cells: the good cells' files stand
                final = self._end(job.id, JobStatus.failed, workdir, error=problem_of(failed, spec),
                                  artifacts=artifacts, report=report)
            else:
                final = self._end(job.id, JobStatus.succeeded, workdir, artifacts=artifacts, report=report)
        except CancelledError as exc:
            final = self._after_cancel(job, entry, exc, workdir)
        except BnrecalError as exc:
            problem = problem_of(self._disk_full(exc, workdir) or exc, spec)
            final = self._end(job.id, JobStatus.failed, workdir, error=problem)
        except Exception as exc:  # noqa: BLE001 - a job's bug must fail the job, not the server
            if entry.lost:  # already queued again (its Ray went with a stopping server) or taken over
                log.info("job %s: ended by %s after it went back to the queue", job.id, first_line(exc))
                final = JobStatus.queued
                return
            full = self._disk_full(exc, workdir)
            if full is None:
                log.exception("job %s failed unexpectedly", job.id)
            error = full or BnrecalError(f"internal error: {type(exc).__name__}: {str(exc)[:200]}")
            final = self._end(job.id, JobStatus.failed, workdir, error=problem_of(error))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            with self._lock:
                self._running.pop(job.id, None)
            if final is not JobStatus.queued:
                self.metrics.job_seconds.labels(status=final.value).observe(time.monotonic() - started)
            self.feed.publish(job.id)
            self.wake()

    def _after_cancel(self, job: JobRecord, entry: _Running, exc: CancelledError, workdir: Path) -> JobStatus:
        """The status a stopped job ends in: queued again when this replica shut down or lost
        its lease, else cancelled."""
        if entry.lost:
            return JobStatus.queued  # the replica that took it over runs it and writes its outcome
        try:
            if entry.shutdown and not self.ledger.get_any(job.id).cancel_requested:
                self.leases.requeue(job.id)
                return JobStatus.queued
        except Exception:  # noqa: BLE001 - the lease runs out and queues it again
            log.exception("job %s: could not queue it again on shutdown", job.id)
            return JobStatus.queued
        return self._end(job.id, JobStatus.cancelled, workdir, error=problem_of(exc))

    def _end(self, job_id: str, status: JobStatus, workdir: Path, **outcome: Any) -> JobStatus:
        """Write the job's outcome; ``status`` once written, else ``queued``: the job is left to
        its lease, which runs out and queues it again (or fails it)."""
        return status if self.leases.finish_making_room(job_id, status, workdir, **outcome) else JobStatus.queued

    def _run(
        self, job: JobRecord, spec: JobSpec, cancel: threading.Event, workdir: Path
    ) -> tuple[dict[str, Artifact], dict[str, Any], BnrecalError | None]:
        """Run the job on the job host (recalibrate, export, write the files), then store
        the files it wrote as the tenant's blobs; a sweep's cells are stored as each finishes.
        The artifacts, the report, and a sweep's error when some of its cells failed."""
        if self.ledger.get_any(job.id).cancel_requested:
            raise CancelledError("the job was cancelled")
        check_reserve(Path(self.settings.data_dir), self.settings.min_free_bytes)  # refused before it runs
        live: _LiveSweep | None = None
        if spec.is_sweep:
            work: RecalibrationRequest | SweepFiles = sweep_files(job, spec, self.blobs, self.settings)
            live = _LiveSweep(self, job, spec, work)
        else:
            work = job_request(job, spec, self.blobs, self.settings)
        progress = JobProgress(job.id, self.ledger, self.feed, self.metrics, live.on_cell if live else None)
        label = JobLabel(job.id, job.created_at, {  # the report names its job
            field: {"filename": self.blobs.filename(job.tenant, digest), "digest": digest}
            for field, digest in job.input_digests().items()
        })
        made = self.host.run(job.id, work, self.settings, spec, workdir, cancel, progress.on_events, label)
        artifacts = dict(live.artifacts) if live is not None else {}
        artifacts.update({name: self.store_artifact(job, file, media_type) for name, (file, media_type) in made.files.items()})
        return artifacts, made.report, made.failed

    @staticmethod
    def _disk_full(exc: BaseException, workdir: Path) -> InsufficientStorageError | None:
        """The 507 for a job that failed because the disk filled up while it wrote its work dir
        (torch's "file write failed", an export's ENOSPC); None for any other failure."""
        if isinstance(exc, InsufficientStorageError):
            return exc
        if isinstance(exc, InputError):  # the job's input was at fault, whatever the disk
            return None
        return disk_full_error(exc, "the job's work dir", workdir, "the job's results could not be written")

    def store_artifact(self, job: JobRecord, file: Path, media_type: str) -> Artifact:
        """Move a file the job wrote into the tenant's blobs: the artifact entry the job resource shows."""
        info: BlobInfo = self.blobs.adopt(job.tenant, file)
        return Artifact(digest=info.digest, size=info.size, filename=file.name, media_type=media_type)


class _LiveSweep:
    """A running sweep as the ledger shows it: each cell's files stored as soon as the host
    reports the cell done, and the matrix as it fills in (``report``), so a client downloads a
    cell's files, and a page draws the matrix, while the sweep goes on (docs/sweeps.md)."""

    def __init__(self, runner: JobRunner, job: JobRecord, spec: JobSpec, sweep: SweepFiles) -> None:
        self.runner, self.job = runner, job
        labelled = any(s.eval_data is not None for s in sweep.sets)
        self.matrix = SweepReport(models=[m.name for m in sweep.models], sets=[s.name for s in sweep.sets], cells=[],
                                  rank_by=sweep_rank_by(spec, labelled), workers=spec.workers)
        self.artifacts: dict[str, Artifact] = {}

    def on_cell(self, done: CellDone) -> None:
        """Store a finished cell's files and show it in the job's matrix."""
        for name, (file, media_type) in done.files.items():
            self.artifacts[name] = self.runner.store_artifact(self.job, file, media_type)
        self.matrix.cells.append(done.summary)
        self.matrix.rank()
        try:
            self.runner.ledger.set_partial(self.job.id, dict(self.artifacts), self.matrix.to_dict())
        except InsufficientStorageError:  # the sweep goes on; its end writes every artifact
            log.warning("job %s: the disk is full; cell %s/%s was not written yet", self.job.id,
                        done.summary.model, done.summary.set_name)
            return
        self.runner.feed.publish(self.job.id)
