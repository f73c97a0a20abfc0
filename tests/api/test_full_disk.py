"""A full disk is a 507 naming what did not fit, never a 500, and loses nothing: a real server
whose data dir is a small tmpfs (mounted here; skipped where mounting is not permitted),
on the session's Ray. The disk is filled with a filler file to a chosen number of free bytes."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bnrecal.service.jobserver.server import tenant_of_key
from tests.api.conftest import submit, upload, wait_for, write_samples
from tests.api.test_storage import KEY, client_of, job_spec, problem, serve
from tests.conftest import save_state
from tests.disks import mounted_tmpfs
from tests.nets import mixed_net, perturbed

pytestmark = [
    pytest.mark.usefixtures("ray_cluster"),
    # a job thread that raises past its handler (an outcome the full ledger refused) fails the test
    pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
]

DISK_BYTES = 64 * 2**20
WIDE = 40_000  # channels of mixed_net: a checkpoint of about 10 MB


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs of its own (root only; skipped where mounting is not permitted)."""
    with mounted_tmpfs(tmp_path / "disk", f"{DISK_BYTES // 2**20}m") as disk:
        yield disk


def leave_free(disk: Path, free: int) -> Path:
    """Fill ``disk`` until about ``free`` bytes are left (0: until the writes fail)."""
    filler = disk / "filler"
    block = b"\0" * 2**20
    with open(filler, "ab") as handle:
        try:
            while (room := shutil.disk_usage(disk).free - free) > 0:
                handle.write(block[: min(len(block), room)])
                handle.flush()
        except OSError:
            pass
    return filler


def digests_and_bytes(live) -> dict[str, str]:
    blobs = live.services.blobs
    tenant = tenant_of_key(KEY)
    return {digest: hashlib.sha256(blobs.path(tenant, digest).read_bytes()).hexdigest() for digest in (blob.digest for blob in blobs.stored(tenant))}


def test_at_zero_bytes_free_uploads_and_submissions_are_507_and_nothing_stored_is_lost(small_disk, tmp_path):
    with serve(small_disk, gc_interval_s=0, scrub_interval_s=0, min_free_bytes=4 * 2**20) as live, \
            client_of(live) as client:
        torch.manual_seed(0)
        checkpoint = upload(client, save_state(tmp_path / "m.pt", perturbed(mixed_net())))
        data = upload(client, write_samples(tmp_path / "x.npy", 16)[0])
        done = wait_for(client, submit(client, job_spec(checkpoint, data))["id"])
        assert done["status"] == "succeeded", done["error"]
        before = digests_and_bytes(live)
        filler = leave_free(small_disk, 0)

        refused = problem(client.post("/v1/jobs", json=job_spec(checkpoint, data)), 507)
        assert "BNRECAL_MIN_FREE_BYTES" in refused["detail"] and refused["type"].endswith("/insufficient-storage")
        full = problem(client.post("/v1/blobs", content=b"n" * 300_000), 507)
        assert "blob store" in full["detail"]
        # the same connection goes on serving, and everything stored before is there, intact
        assert client.get(f"/v1/jobs/{done['id']}").json()["status"] == "succeeded"
        assert digests_and_bytes(live) == before
        assert live.services.blobs.staging_files() == []
        assert client.get(f"/v1/jobs/{done['id']}/artifacts/checkpoint").status_code == 200

        filler.unlink()  # room again: work goes on
        assert wait_for(client, submit(client, job_spec(checkpoint, data))["id"])["status"] == "succeeded"


def test_a_job_whose_checkpoint_does_not_fit_fails_507_and_one_that_fits_once_succeeds(small_disk, tmp_path):
    with serve(small_disk, gc_interval_s=0, scrub_interval_s=0, min_free_bytes=0) as live, client_of(live) as client:
        torch.manual_seed(0)
        model_file = save_state(tmp_path / "wide.pt", perturbed(mixed_net(WIDE)))
        size = model_file.stat().st_size
        checkpoint = upload(client, model_file)
        data = upload(client, write_samples(tmp_path / "x.npy", 8)[0])
        spec = job_spec(checkpoint, data, model_kwargs={"channels": WIDE})
        before = digests_and_bytes(live)

        filler = leave_free(small_disk, 2 * 2**20)  # far less than the checkpoint
        failed = wait_for(client, submit(client, spec)["id"], timeout=300)
        assert failed["status"] == "failed" and failed["error"]["status"] == 507, failed["error"]
        assert "work dir" in failed["error"]["detail"] and failed["artifacts"] == {}
        assert digests_and_bytes(live) == before  # nothing partial stored, nothing lost
        assert not any((small_disk / "data" / "work").glob("*"))  # its work dir is gone

        filler.unlink()
        leave_free(small_disk, size + 6 * 2**20)  # room for the checkpoint once, not twice
        done = wait_for(client, submit(client, spec)["id"], timeout=300)
        assert done["status"] == "succeeded", done["error"]
        got = client.get(f"/v1/jobs/{done['id']}/artifacts/checkpoint")
        assert hashlib.sha256(got.content).hexdigest() == done["artifacts"]["checkpoint"]["digest"].removeprefix("sha256:")
