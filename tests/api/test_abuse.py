"""Issue 21's probes replayed against a real server: each gets its 4xx at submission (or a
job that fails fast as bad input), no answer is a 5xx, the server does not grow, and a job
the tenant ran before is intact afterwards. ``bench/soak.py --probes`` keeps replaying them
beside real jobs."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch

from tests.api.abuse import PROBES, check, upload_blobs
from tests.api.conftest import submit, wait_for
from tests.nets import mixed_net, perturbed

pytestmark = pytest.mark.usefixtures("ray_cluster")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:  # the live server runs in this process
        return int(statm.read().split()[1]) * 4096


def checkpoint_bytes() -> bytes:
    torch.manual_seed(0)
    buffer = io.BytesIO()
    torch.save(perturbed(mixed_net()).state_dict(), buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tenant(live_server):
    import numpy as np

    data = io.BytesIO()
    np.save(data, np.random.default_rng(1).normal(size=(16, 3, 6, 5)).astype(np.float32))
    with live_server.client("abuse") as client:
        blobs = upload_blobs(client, checkpoint_bytes(), data.getvalue())
        job = wait_for(client, submit(client, blobs.spec(batch_size=8))["id"])
        assert job["status"] == "succeeded", job["error"]
        artifacts = {
            name: hashlib.sha256(client.get(f"/v1/jobs/{job['id']}/artifacts/{name}").content).hexdigest()
            for name in job["artifacts"]
        }
    return blobs, job, artifacts


@pytest.mark.parametrize("probe", PROBES, ids=[probe.name for probe in PROBES])
def test_each_probe_gets_its_answer(live_server, tenant, probe):
    blobs, _, _ = tenant
    with live_server.client("abuse") as client:
        assert check(probe, client, blobs) is None


def test_replayed_probes_leave_the_server_and_earlier_results_as_they_were(live_server, tenant):
    blobs, job, artifacts = tenant
    answers = []

    def count(response):
        answers.append(response.status_code)

    with live_server.client("abuse", event_hooks={"response": [count]}) as client:
        quick = [probe for probe in PROBES if probe.job_error is None]
        for probe in quick:  # a first round: what stays allocated after it is the baseline
            check(probe, client, blobs)
        before = resident_bytes()
        failures = [failure for _ in range(3) for probe in quick if (failure := check(probe, client, blobs))]
        grown = resident_bytes() - before
        assert failures == []
        assert not [code for code in answers if code >= 500]
        assert grown < 100 * 2**20, grown
        again = client.get(f"/v1/jobs/{job['id']}").json()
        assert again["status"] == "succeeded" and again["artifacts"] == job["artifacts"]
        for name, digest in artifacts.items():
            body = client.get(f"/v1/jobs/{job['id']}/artifacts/{name}").content
            assert hashlib.sha256(body).hexdigest() == digest, name
