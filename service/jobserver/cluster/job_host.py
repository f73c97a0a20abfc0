"""The job host: the Ray actor where a server's jobs load, probe, export and write their models.

Nothing a tenant sends is allocated in the API process. A job's driver work -- building
the model and loading its checkpoint (or program), probing one sample, describing and
shipping the data, the ONNX export, saving the checkpoint and writing the report files --
runs in a thread of one :class:`JobHost` actor, a process of its own. The server keeps
the ledger, the blob store and the event streams: it asks the host to run a job into the
job's work folder, follows its progress, and adopts the files the host wrote as the
tenant's blobs. A model too big for memory kills the host, not the server; the jobs
running there fail with a clear problem, and the next job starts a fresh host.

The host is pinned to the server's own Ray node (the work folder and the blobs are files
under the server's data dir) and asks for no CPUs, so it never takes a rank's place. It
owns the warm pool (:class:`WarmPool`): rank actors are owned by the process that starts
them and die with it, so the pool lives where the jobs start their ranks.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError, WorkerCrashedError
from ray.util.placement_group import get_placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from bnrecal.errors import BnrecalError, CancelledError, RunError, first_line
from bnrecal.workers.ranks.gangs.pool import GangKey, WarmPool

from bnrecal.service.run.recalibrate import RecalibrationRequest
from bnrecal.service.run.report.page import JobLabel

from bnrecal.service.settings import Settings
from bnrecal.service.sweep.cells import SweepFiles
from bnrecal.service.jobserver.cluster.hosted_work import Event, HostedWork, JobFiles, run_job, run_sweep_job
from bnrecal.service.jobserver.records.spec import JobSpec

log = logging.getLogger("bnrecal.job_host")

HOST_JOB_THREADS = 64
"""Jobs one host runs at once (the runner starts no more than the cluster's CPUs hold)."""

POLL_INTERVAL_S = 0.25
"""Longest the server waits on the host for a job's next progress (a cancel is forwarded between waits)."""


@dataclass(frozen=True)
class IdleGang:
    """What the server sees of an idle warm gang in the host: its shape, which gang it is
    (the same ``ident`` while the same actors serve), how many jobs it served and its ranks'
    process ids (empty when a rank did not answer)."""

    key: GangKey
    ident: int
    jobs: int
    pids: tuple[int, ...] = ()


class _HostedJob:
    """A job in the host: its cancel switch, and the progress the server has not collected yet."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self.events: list[Event] = []
        self.ended = False
        self.changed = threading.Condition()

    def report(self, event: Event) -> None:
        """Keep ``event`` for the server (a newer count of the same phase replaces an uncollected one)."""
        with self.changed:
            last = self.events[-1] if self.events else None
            if isinstance(last, tuple) and isinstance(event, tuple) and last[0] is not None and event[0] is not None \
                    and last[2] == event[2]:
                self.events[-1] = event
            else:
                self.events.append(event)
            self.changed.notify_all()

    def end(self) -> None:
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def collect(self, wait_s: float) -> tuple[list[Event], bool]:
        """The events since the last call, waiting up to ``wait_s`` for one; and whether the job has ended."""
        with self.changed:
            self.changed.wait_for(lambda: self.events or self.ended, timeout=wait_s)
            events, self.events = self.events, []
            return events, self.ended


@ray.remote(concurrency_groups={"jobs": HOST_JOB_THREADS, "control": HOST_JOB_THREADS + 4})
class JobHost:
    """The actor that runs the server's jobs' driver work, in a thread per job; progress, cancel
    and pool calls have threads of their own (one per job's long-poll, and a few more)."""

    def __init__(self, warm_pool_idle_s: float, group_prefix: str) -> None:
        import torch

        torch.set_num_threads(max(1, os.cpu_count() or 1))  # as the server process had: Ray sets 1 for num_cpus=0
        self.pool = WarmPool(warm_pool_idle_s, group_prefix)
        self._jobs: dict[str, _HostedJob] = {}
        self._lock = threading.Lock()

    @ray.method(concurrency_group="control")
    def ready(self) -> int:
        """This process's id, once the host is up (torch and the job code came with this module)."""
        return os.getpid()

    @ray.method(concurrency_group="jobs")
    def run(
        self, job_id: str, request: RecalibrationRequest | SweepFiles, settings: Settings, spec: JobSpec,
        workdir: Path, label: JobLabel | None = None,
    ) -> JobFiles:
        """Run one job (or sweep) into ``workdir``; its errors are raised as they are (the server records them)."""
        job = self._job(job_id)
        try:
            work = HostedWork(settings, spec, workdir, job.report, job.cancel, self.pool)
            if isinstance(request, SweepFiles):
                return run_sweep_job(request, work)
            return run_job(request, work, label)
        finally:
            job.end()

    def _job(self, job_id: str) -> _HostedJob:
        """The job's entry, made by whichever comes first: the job, its first progress call or a cancel."""
        with self._lock:
            return self._jobs.setdefault(job_id, _HostedJob())

    @ray.method(concurrency_group="control")
    def progress(self, job_id: str, wait_s: float) -> tuple[list[Event], bool]:
        """The job's progress since the last call, as soon as there is some (or after ``wait_s``),
        and whether the job has ended; once the server has collected all of it, the job is forgotten."""
        job = self._job(job_id)
        events, ended = job.collect(wait_s)
        if ended:
            with self._lock:
                self._jobs.pop(job_id, None)
        return events, ended

    @ray.method(concurrency_group="control")
    def cancel(self, job_id: str) -> None:
        """Cancel a job (its actors are killed), also one that has not begun here yet."""
        self._job(job_id).cancel.set()

    @ray.method(concurrency_group="control")
    def idle_gangs(self) -> list[IdleGang]:
        """The warm pool's idle gangs, oldest first."""
        gangs = []
        for gang in self.pool.idle():
            try:
                pids = tuple(state.pid for state in ray.get([a.state.remote() for a in gang.actors], timeout=10))
            except Exception:  # noqa: BLE001 - a rank that died idle: the next job's check kills its gang
                pids = ()
            gangs.append(IdleGang(gang.key, id(gang), gang.jobs, pids))
        return gangs

    @ray.method(concurrency_group="control")
    def evict_for(self, need: dict[str, float]) -> int:
        """Kill idle gangs until ``need`` fits in the cluster's free resources; how many."""
        return self.pool.evict_for(need)

    @ray.method(concurrency_group="control")
    def close(self) -> None:
        """Kill the idle gangs and keep none from now on."""
        self.pool.close()


class JobHostClient:
    """The server's side of the job host: starts it (again, after it died), runs jobs on it
    and follows them, and shows its warm pool (``idle``, ``evict_for``, ``close``)."""

    def __init__(self, warm_pool_idle_s: float) -> None:
        self.warm_pool_idle_s = warm_pool_idle_s
        self._handle: Any = None
        self._prefix = ""  # names the placement groups of the running host's gangs
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> Any:
        """The host actor, started on this process's Ray node if there is none (or it died)."""
        with self._lock:
            if self._closed:
                raise CancelledError("the server is shutting down")
            if self._handle is None:
                node = ray.get_runtime_context().get_node_id()
                self._prefix = f"bnrecal-host-{uuid.uuid4().hex[:12]}-"
                self._handle = JobHost.options(
                    num_cpus=0,
                    max_restarts=0,
                    max_task_retries=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
                ).remote(self.warm_pool_idle_s, self._prefix)
            return self._handle

    def wait_ready(self, timeout: float) -> int | None:
        """Wait until the host is up (its process started, torch and the job code imported), so
        the first job does not pay for that; its process id, or None if it is not up in time."""
        try:
            return ray.get(self.start().ready.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001 - not up yet (a busy machine) or dead: the first job starts it again
            log.warning("the job host was not ready within %g s; the first job waits for it", timeout, exc_info=True)
            return None

    def _forget(self, handle: Any) -> None:
        """Drop a host that died, so the next job starts a fresh one, and free what its gangs
        reserved: Ray kills the rank actors a dead process owned, but not their placement groups."""
        with self._lock:
            if self._handle is not handle:
                return
            self._handle, prefix = None, self._prefix
        _remove_groups(prefix)

    def run(
        self,
        job_id: str,
        request: RecalibrationRequest | SweepFiles,
        settings: Settings,
        spec: JobSpec,
        workdir: Path,
        cancel: threading.Event,
        on_events: Any,
        label: JobLabel | None = None,
    ) -> JobFiles:
        """Run a job on the host, passing its progress to ``on_events`` a few times a second and
        a cancel on to the host; the host's errors are raised here as the host raised them."""
        host = self.start()
        done = host.run.remote(job_id, request, settings, spec, workdir, label)
        cancelled = False
        try:
            while True:
                if cancel.is_set() and not cancelled:
                    host.cancel.remote(job_id)
                    cancelled = True
                events, ended = ray.get(host.progress.remote(job_id, POLL_INTERVAL_S))  # returns at the first event
                try:
                    on_events(events)  # a sweep's cells are stored here as they finish
                except BaseException:
                    host.cancel.remote(job_id)  # the job fails here: the host must not run on unheard
                    raise
                if ended or ray.wait([done], timeout=0)[0]:  # ended: the result is on its way
                    return ray.get(done)
        except RayTaskError as exc:
            cause = exc.cause
            if not isinstance(cause, BnrecalError):  # a bug: keep the host's traceback in the server's log
                log.error("job %s raised in the job host:\n%s", job_id, exc)
            if isinstance(cause, Exception):
                raise cause from None
            raise
        except (RayActorError, WorkerCrashedError, OutOfMemoryError) as exc:
            self._forget(host)
            detail = first_line(exc)
            raise RunError(
                "the job host (the process that loads the model, probes the data and writes the results, "
                f"beside the API server) died while running this job, out of memory for this model perhaps: {detail}"
            ) from None

    def idle(self) -> list[IdleGang]:
        """The host's idle warm gangs (none while no host runs)."""
        handle = self._handle
        if handle is None:
            return []
        try:
            return ray.get(handle.idle_gangs.remote())
        except RayActorError:
            return []

    def evict_for(self, need: dict[str, float]) -> int:
        """Kill the host's idle gangs until ``need`` fits in the cluster's free resources."""
        handle = self._handle
        if handle is None:
            return 0
        try:
            return ray.get(handle.evict_for.remote(need))
        except RayActorError:
            return 0

    def close(self, timeout: float = 10.0) -> None:
        """Kill the warm gangs and the host (its rank actors die with it); start none after."""
        with self._lock:
            self._closed, handle, self._handle = True, self._handle, None
        if handle is None:
            return
        try:
            ray.get(handle.close.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001 - dead or stuck: killed below all the same
            log.warning("the job host did not close its warm pool in time", exc_info=True)
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        _remove_groups(self._prefix)


def _remove_groups(prefix: str) -> None:
    """Remove the placement groups named with ``prefix`` (a dead host's gangs') that are still there."""
    if not prefix:
        return
    for group in ray.util.placement_group_table().values():
        if group["name"].startswith(prefix) and group["state"] != "REMOVED":
            try:
                remove_placement_group(get_placement_group(group["name"]))
            except Exception:  # noqa: BLE001 - removed meanwhile
                log.warning("could not remove placement group %s", group["name"], exc_info=True)
