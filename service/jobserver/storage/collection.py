"""Storage lifecycle: what may be deleted, per-tenant usage, and the deletions themselves.

The ledger decides what is still needed. A job that is queued or running (*live*) needs
its checkpoint and data blobs and the unpack of its archive; a finished job younger than
``BNRECAL_JOB_RETENTION_S`` (*retained*) needs its input blobs and its artifacts. The
collector deletes only what none of them needs:

- finished jobs past their retention: the ledger row, then each artifact blob no other
  job references;
- blobs no job references, unused (by mtime; an upload of the same bytes or a submission
  refreshes it) for ``BNRECAL_BLOB_RETENTION_S``; a blob written after the oldest running
  job started is kept too (it may be an artifact whose job has not finished yet);
- unpacked archives no live job uses, last used ``BNRECAL_UNPACK_RETENTION_S`` ago, or at
  once when a failed job marked them discarded;
- staging files (half uploads, half unpacks) a day old.

Each deletion is decided again right before it happens, against the ledger as it is
then, so the server's periodic collection and an operator's ``bnrecal gc`` may run at
the same time as jobs start and finish.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from bnrecal.workers.data.formats.archive import COLLECTED_ROOT_MARKER, is_discarded_unpack, is_unpack_folder
from bnrecal.errors import ConflictError, NotFoundError

from bnrecal.service.settings import Settings
from bnrecal.service.jobserver.storage.blobs import BlobStore, is_digest
from bnrecal.service.jobserver.records.record import JobRecord
from bnrecal.service.jobserver.records.spec import spec_digests, spec_inputs
from bnrecal.service.jobserver.records.views import JobStatus
from bnrecal.service.jobserver.ledger import Ledger
from bnrecal.service.jobserver.ledger.engines import exclusive_turn
from bnrecal.service.jobserver.periodic import Periodic

log = logging.getLogger("bnrecal.storage")

STALE_STAGING_S = 86400.0
"""Staging files (uploads, unpacks) untouched this long were left by a crash or a dead client."""

Kind = Literal["job", "blob", "unpack", "staging"]


@dataclass(frozen=True)
class Removal:
    """One thing the collector deletes: a job, a blob, an unpack folder or a staging file."""

    kind: Kind
    name: str  # job id, digest, unpack folder or staging file name
    size: int  # bytes freed (a job's own row frees none; its artifacts are listed as blobs)
    reason: str
    tenant: str | None = None


@dataclass
class CollectionReport:
    """What a collection deleted (or, dry, would delete), and how many bytes that frees."""

    removals: list[Removal] = field(default_factory=list)
    dry_run: bool = False

    @property
    def freed_bytes(self) -> int:
        """Bytes the removals free."""
        return sum(removal.size for removal in self.removals)

    def count(self, kind: Kind) -> int:
        """How many removals of one kind."""
        return sum(1 for removal in self.removals if removal.kind == kind)

    def summary(self) -> str:
        """One line: counts per kind and bytes."""
        verb = "would free" if self.dry_run else "freed"
        counts = ", ".join(f"{self.count(kind)} {kind}s" for kind in ("job", "blob", "unpack", "staging"))
        return f"{verb} {self.freed_bytes} bytes: {counts}"


@dataclass(frozen=True)
class _Needs:
    """What the ledger says is needed right now."""

    blobs: set[tuple[str, str]]  # (tenant, digest) of live and retained jobs
    live_hexes: set[str]  # hex digests of live jobs' data (their unpacks)
    live_paths: bool  # a live job reads data from a server path (its unpack cannot be named)
    last_used: dict[str, datetime]  # hex digest -> latest start or end of a job using it
    oldest_running: float | None  # epoch seconds the oldest running job started
    expired: list[JobRecord]


def job_digests(job: JobRecord, artifacts: bool = True) -> set[str]:
    """The blob digests a job references: those of its spec and (if asked) its artifacts."""
    found = {value for value in spec_digests(job.spec).values() if is_digest(value)}
    if artifacts:
        found |= {artifact.digest for artifact in job.artifacts.values() if is_digest(artifact.digest)}
    return found


def _uses_server_path(job: JobRecord) -> bool:
    return any(isinstance(value, dict) for value in spec_inputs(job.spec).values())


def folder_bytes(folder: Path) -> int:
    """The bytes of the regular files under a folder (0 if it is gone)."""
    total = 0
    for base, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except FileNotFoundError:
                continue
    return total


class StorageCollector:
    """Deletes expired jobs, unreferenced blobs and stale unpacks; measures tenants' usage."""

    def __init__(self, settings: Settings, ledger: Ledger, blobs: BlobStore) -> None:
        self.settings = settings
        self.ledger = ledger
        self.blobs = blobs
        self.unpack_root = Path(settings.data_access().unpack_root)
        self._lock = threading.Lock()  # one collection (or deletion) at a time in this process
        self._periodic = Periodic("bnrecal-collector", settings.gc_interval_s, self._collect_once,
                                  "storage collection failed", log)

    # -- the periodic collection -------------------------------------------------------

    def start(self) -> None:
        """Collect every ``BNRECAL_GC_INTERVAL_S`` seconds in a daemon thread (not at all if 0)."""
        self._periodic.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the periodic collection (a collection under way finishes first)."""
        self._periodic.stop(timeout)

    def _collect_once(self) -> None:
        with exclusive_turn(self.ledger.engine, "storage collector") as mine:
            if not mine:  # another replica is collecting the shared store right now
                return
            report = self.collect()
        if report.removals:
            log.info("storage collection %s", report.summary())

    # -- collection ----------------------------------------------------------------------

    def collect(self, dry_run: bool = False, now: float | None = None) -> CollectionReport:
        """Delete (or, dry, list) everything no live or retained job needs and retention lets go."""
        with self._lock:
            now = time.time() if now is None else now
            report = CollectionReport(dry_run=dry_run)
            needs = self._needs(now)
            freed_artifacts: set[tuple[str, str]] = set()
            for job in needs.expired:
                if dry_run or self._remove_job(job):
                    reason = "finished past BNRECAL_JOB_RETENTION_S"
                    report.removals.append(Removal("job", job.id, 0, reason, job.tenant))
                    freed_artifacts.update((job.tenant, a.digest) for a in job.artifacts.values())
            if not dry_run:
                needs = self._needs(now)  # the rows are gone: their artifacts are unreferenced now
            report.removals += self._collect_blobs(needs, now, dry_run, freed_artifacts)
            report.removals += self._collect_unpacks(needs, now, dry_run)
            report.removals += self._collect_staging(now, dry_run)
            return report

    def _needs(self, now: float) -> _Needs:
        cutoff = now - self.settings.job_retention_s
        blobs: set[tuple[str, str]] = set()
        live_hexes: set[str] = set()
        live_paths = False
        last_used: dict[str, datetime] = {}
        oldest_running: float | None = None
        expired: list[JobRecord] = []
        for job in self.ledger.every_job():
            if job.status.is_terminal and (job.finished_at or job.created_at).timestamp() < cutoff:
                expired.append(job)
                continue
            blobs.update((job.tenant, digest) for digest in job_digests(job))
            inputs = {digest.removeprefix("sha256:") for digest in job_digests(job, artifacts=False)}
            used = job.finished_at or job.started_at or job.created_at
            for hex_digest in inputs:
                last_used[hex_digest] = max(last_used.get(hex_digest, used), used)
            if not job.status.is_terminal:
                live_hexes.update(inputs)
                live_paths = live_paths or _uses_server_path(job)
            if job.started_at is not None and job.status is JobStatus.running:
                started = job.started_at.timestamp()
                oldest_running = started if oldest_running is None else min(oldest_running, started)
        return _Needs(blobs, live_hexes, live_paths, last_used, oldest_running, expired)

    def _remove_job(self, job: JobRecord) -> bool:
        try:
            self.ledger.delete_finished(None, job.id)
        except (ConflictError, NotFoundError) as exc:  # deleted by someone else, or (never) live again
            log.debug("job %s not collected: %s", job.id, exc)
            return False
        return True

    def _collect_blobs(
        self, needs: _Needs, now: float, dry_run: bool, freed_artifacts: set[tuple[str, str]]
    ) -> list[Removal]:
        """Unreferenced blobs unused past retention, and the artifacts of the jobs just collected.

        A blob written since the oldest running job started is kept whatever its retention:
        it may be an artifact whose job has not reached the ledger yet.
        """
        running_cutoff = now if needs.oldest_running is None else min(now, needs.oldest_running)
        retention_cutoff = min(now - self.settings.blob_retention_s, running_cutoff)
        removals: list[Removal] = []
        for tenant in self.blobs.tenants():
            for blob in list(self.blobs.stored(tenant)):
                digest = blob.digest
                if (tenant, digest) in needs.blobs:
                    continue
                artifact = (tenant, digest) in freed_artifacts
                cutoff = running_cutoff if artifact else retention_cutoff
                if blob.last_used >= cutoff or (not dry_run and self._refreshed(tenant, digest, cutoff)):
                    continue
                size = blob.size if dry_run else self.blobs.remove(tenant, digest)
                reason = "artifact of a collected job" if artifact else "no job uses it, unused past BNRECAL_BLOB_RETENTION_S"
                removals.append(Removal("blob", digest, size, reason, tenant))
        return removals

    def _refreshed(self, tenant: str, digest: str, cutoff: float) -> bool:
        """Right before deleting: whether the blob was just uploaded again or submitted (or is gone)."""
        try:
            return self.blobs.last_used(tenant, digest) >= cutoff
        except (OSError, NotFoundError):
            return True

    def _collect_unpacks(self, needs: _Needs, now: float, dry_run: bool) -> list[Removal]:
        if not self.unpack_root.is_dir():
            return []
        cutoff = now - self.settings.unpack_retention_s
        known_hexes = {blob.digest.removeprefix("sha256:") for tenant in self.blobs.tenants()
                       for blob in self.blobs.stored(tenant)}
        removals: list[Removal] = []
        for folder in sorted(self.unpack_root.iterdir()):
            if folder.name.startswith(".") or not folder.is_dir() or not is_unpack_folder(folder):
                continue
            reason = self._unpack_verdict(folder, needs, known_hexes, cutoff)
            if reason is None:
                continue
            if not dry_run and self._unpack_verdict(folder, self._needs(now), known_hexes, cutoff) is None:
                continue  # a job that uses it was queued meanwhile
            size = folder_bytes(folder)
            if not dry_run:
                _remove_tree(folder)
            removals.append(Removal("unpack", folder.name, size, reason))
        return removals

    @staticmethod
    def _unpack_verdict(folder: Path, needs: _Needs, known_hexes: set[str], cutoff: float) -> str | None:
        """Why an unpack folder may go (None: it stays). Its name is the archive's SHA-256."""
        if folder.name in needs.live_hexes or (needs.live_paths and folder.name not in known_hexes):
            return None
        if is_discarded_unpack(folder):
            return "discarded after a job failed on its content"
        try:
            used = folder.stat().st_mtime
        except FileNotFoundError:
            return None
        last_job = needs.last_used.get(folder.name)
        if last_job is not None:
            used = max(used, last_job.timestamp())
        if used < cutoff:
            return "no live job uses it, unused past BNRECAL_UNPACK_RETENTION_S"
        return None

    def _collect_staging(self, now: float, dry_run: bool) -> list[Removal]:
        cutoff = now - STALE_STAGING_S
        candidates: Iterable[Path] = self.blobs.staging_files()
        if self.unpack_root.is_dir():
            candidates = [*candidates, *self.unpack_root.glob(".unpack-*"), *self.unpack_root.glob(".removing-*")]
        removals: list[Removal] = []
        for path in candidates:
            try:
                if path.stat().st_mtime >= cutoff:
                    continue
            except FileNotFoundError:
                continue
            size = folder_bytes(path) if path.is_dir() else path.stat().st_size
            if not dry_run:
                _remove_tree(path)
            removals.append(Removal("staging", path.name, size, "left half written a day ago"))
        return removals

    # -- deletions users ask for -----------------------------------------------------------

    def delete_job(self, tenant: str, job_id: str) -> int:
        """Delete a tenant's finished job and free its artifacts that no other job references; bytes freed.

        ``ConflictError`` while the job is queued or running, ``NotFoundError`` if unknown.
        """
        with self._lock:
            job = self.ledger.delete_finished(tenant, job_id)
            now = time.time()
            needs = self._needs(now)
            running_cutoff = now if needs.oldest_running is None else min(now, needs.oldest_running)
            referenced = {(other.tenant, digest) for other in self.ledger.every_job() for digest in job_digests(other)}
            freed = 0
            for artifact in job.artifacts.values():
                digest = artifact.digest
                if (tenant, digest) in referenced:
                    continue
                if not self._refreshed(tenant, digest, running_cutoff):  # not being stored again right now
                    freed += self.blobs.remove(tenant, digest)
            return freed

    def delete_blob(self, tenant: str, digest: str) -> int:
        """Delete a tenant's blob (and its unpack, unless another tenant holds the same bytes); bytes freed.

        ``ConflictError`` while a queued or running job of the tenant uses it, ``NotFoundError`` if unknown.
        """
        with self._lock:
            self.blobs.path(tenant, digest)  # NotFoundError first
            for job in self.ledger.every_job():
                if job.tenant == tenant and not job.status.is_terminal and digest in job_digests(job):
                    raise ConflictError(
                        f"blob {digest} is used by job {job.id} ({job.status.value}); "
                        "delete it once the job has finished, or cancel the job"
                    )
            freed = self.blobs.remove(tenant, digest)
            hex_digest = digest.removeprefix("sha256:")
            folder = self.unpack_root / hex_digest
            shared = any(self.blobs.exists(other, digest) for other in self.blobs.tenants())
            if folder.is_dir() and not shared and hex_digest not in self._needs(time.time()).live_hexes:
                _remove_tree(folder)
            return freed

    # -- usage -------------------------------------------------------------------------------

    def usage(self, tenant: str) -> int:
        """Bytes a tenant stores: its blobs (uploads and artifacts) and the unpacks of its archives."""
        total = 0
        for blob in self.blobs.stored(tenant):
            total += blob.size
            folder = self.unpack_root / blob.digest.removeprefix("sha256:")
            if folder.is_dir():
                total += folder_bytes(folder)
        return total

    def describe(self) -> dict[str, Any]:
        """The retention settings in force, for logs and ``bnrecal gc``."""
        names = ("job_retention_s", "blob_retention_s", "unpack_retention_s", "gc_interval_s", "tenant_quota_bytes")
        return {name: getattr(self.settings, name) for name in names}


def _remove_tree(path: Path) -> None:
    """Remove a file or folder; a folder is first renamed aside, so nothing sees it half removed."""
    if not path.is_dir():
        path.unlink(missing_ok=True)
        return
    aside = path.with_name(f".removing-{path.name}-{os.getpid()}-{threading.get_ident()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


__all__ = ["COLLECTED_ROOT_MARKER", "CollectionReport", "Removal", "StorageCollector", "folder_bytes", "job_digests"]
