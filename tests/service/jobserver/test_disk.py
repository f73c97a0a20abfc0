"""A full disk told apart from other failures, on a real full file system (a small tmpfs,
mounted here; skipped where mounting is not permitted): the SQLite ledger's "database or disk
is full" and torch's "file write failed" both become the 507 naming the resource, a
ledger write that does not fit loses nothing stored before, and a job that filled the disk
with its own work dir still gets its outcome written."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bnrecal.service.jobserver.disk import check_reserve, disk_full_error, free_bytes
from bnrecal.service.jobserver.jobs.leases import JobLeases, replica_id
from bnrecal.service.jobserver.records.views import JobStatus
from bnrecal.service.jobserver.problems import Problem, http_status
from bnrecal.service.jobserver.ledger import Ledger, sqlite_url
from bnrecal.errors import InsufficientStorageError

from tests.disks import mounted_tmpfs


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "disk", "4m") as disk:
        yield disk


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "ab") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError:
            pass
    return filler


def spec(size: int) -> dict:
    return {"arch": "tests.nets:mixed_net", "checkpoint": "sha256:" + "0" * 64, "data": "sha256:" + "1" * 64,
            "model_kwargs": {"padding": "p" * size}}


def test_a_ledger_write_on_a_full_disk_is_507_naming_the_ledger_and_loses_nothing(small_disk):
    ledger = Ledger(sqlite_url(small_disk))
    try:
        earlier = [ledger.create("alice", spec(1000), None, None)[0] for _ in range(3)]
        filler = fill(small_disk)
        with pytest.raises(InsufficientStorageError, match=r"disk is full \(job ledger\)"):
            for _ in range(200):  # the WAL may take a few more pages before it has to grow
                ledger.create("alice", spec(200_000), None, None)
        kept = {job.id for job in ledger.list("alice", None, 500)}
        assert {job.id for job in earlier} <= kept
        assert all(ledger.get("alice", job.id).spec == spec(1000) for job in earlier)
        filler.unlink()
        assert ledger.create("alice", spec(10), None, None)[1]  # writes work again
    finally:
        ledger.close()


def test_torch_failing_to_save_on_a_full_disk_is_told_as_a_full_disk(small_disk):
    fill(small_disk)
    target = small_disk / "work" / "recalibrated.pt"
    target.parent.mkdir(exist_ok=True)
    with pytest.raises(Exception) as raised:
        torch.save({"weight": torch.zeros(1_000_000)}, target)  # torch's own message: "file write failed"
    error = disk_full_error(raised.value, "the job's work dir", target.parent, "the job's results could not be written")
    assert error is not None and http_status(error) == 507 and "work dir" in error.message


def test_other_failures_are_not_taken_for_a_full_disk(tmp_path):
    assert free_bytes(tmp_path) > 16 * 2**20
    assert disk_full_error(RuntimeError("file write failed"), "work dir", tmp_path, "x") is None  # room enough
    assert disk_full_error(ValueError("shape mismatch"), "work dir", tmp_path, "x") is None
    assert disk_full_error(OSError(28, "No space left on device"), "work dir", tmp_path, "x") is not None


def test_the_reserve_refuses_new_work_naming_the_setting(tmp_path):
    check_reserve(tmp_path, 1)
    with pytest.raises(InsufficientStorageError, match="BNRECAL_MIN_FREE_BYTES"):
        check_reserve(tmp_path, shutil.disk_usage(tmp_path).free + 2**30)


def exhaust_the_ledger(ledger: Ledger) -> None:
    """Write small jobs until even those no longer fit (the WAL has no page left to reuse)."""
    with pytest.raises(InsufficientStorageError):
        for _ in range(10_000):
            ledger.create("alice", spec(10), None, None)


def test_a_job_that_filled_the_disk_with_its_work_dir_still_ends_with_its_507(small_disk):
    ledger = Ledger(sqlite_url(small_disk))
    try:
        leases = JobLeases(ledger, replica_id(), lease_s=30.0)
        job, _ = ledger.create("alice", spec(10), None, None)
        assert leases.claim(job.id) is not None
        workdir = small_disk / "work" / job.id
        workdir.mkdir(parents=True)
        fill(workdir)  # the job's own files took the last byte
        exhaust_the_ledger(ledger)
        problem = Problem(type="about:blank", title="Insufficient Storage", status=507,
                          detail="the server's disk is full (the job's work dir)")
        with pytest.raises(InsufficientStorageError):  # as it stands, the outcome does not fit
            leases.finish(job.id, JobStatus.failed, error=problem)

        assert leases.finish_making_room(job.id, JobStatus.failed, workdir, error=problem)
        assert not workdir.exists()
        ended = ledger.get_any(job.id)
        assert ended.status is JobStatus.failed and ended.error == problem
    finally:
        ledger.close()


def test_an_outcome_that_cannot_be_written_is_logged_not_raised(small_disk, caplog):
    ledger = Ledger(sqlite_url(small_disk))
    try:
        leases = JobLeases(ledger, replica_id(), lease_s=30.0)
        job, _ = ledger.create("alice", spec(10), None, None)
        assert leases.claim(job.id) is not None
        fill(small_disk)  # not the job's: removing its work dir frees nothing
        exhaust_the_ledger(ledger)

        problem = Problem(type="about:blank", title="Failed", status=500, detail="the job failed")
        assert not leases.finish_making_room(job.id, JobStatus.failed, small_disk / "work" / job.id, error=problem)
        assert "its outcome (failed) was not written" in caplog.text
        assert ledger.get_any(job.id).status is JobStatus.running  # left to its lease, which runs out
    finally:
        ledger.close()
