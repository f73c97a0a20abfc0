"""The job host keeps a job's model out of the API process: a real ``bnrecal serve`` runs a
resnet50 job (~100 MB of weights) and its own memory barely moves, while the job's model
is loaded, probed, recalibrated and written in the host actor. A job that kills the host
fails with a clear problem, and the next job gets a fresh host."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.api.conftest import submit, upload, wait_for
from tests.api.server_process import ServerProcess
from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``bnrecal serve`` in a process of its own (with its own embedded Ray), whose memory is measured."""
    folder = tmp_path_factory.mktemp("job-host")
    started = ServerProcess(folder / "data", folder / "server.log")
    yield started
    started.close()


def memory(pid: int) -> dict[str, int]:
    """A process's resident set now (VmRSS) and at its peak (VmHWM), in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


@pytest.mark.slow  # a server start and a resnet50 job: ~40 s on a busy 2-core machine
def test_a_large_model_never_lives_in_the_api_process(server, tmp_path):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    torch.save(model.state_dict(), tmp_path / "resnet50.pt")
    del model
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).normal(size=(4, 3, 32, 32)).astype(np.float32))

    spec = {
        "arch": "torchvision:resnet50",
        "checkpoint": upload(server.client, tmp_path / "resnet50.pt"),
        "data": upload(server.client, tmp_path / "calib.npy"),
        "workers": 1,
        "batch_size": 4,
    }
    # A dry run first: checking the spec imports torchvision in the API process (once, ~160
    # MiB of code, the same for any size of model), which is not the model living there.
    checked = server.client.post("/v1/jobs", params={"dry_run": "true"}, json=spec)
    assert checked.status_code == 200, checked.text
    pid = server.process.pid
    before = memory(pid)
    peak = [before["VmRSS"]]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], memory(pid)["VmRSS"])
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        job = wait_for(server.client, submit(server.client, spec)["id"], timeout=300)
    finally:
        stop.set()
        sampler.join()
    after = memory(pid)
    assert job["status"] == "succeeded", job["error"]
    assert job["report"]["samples"] == 4
    named = job["report"]["job"]  # written in the host, from what the server knows of the job
    assert named["id"] == job["id"] and named["inputs"]["checkpoint"]["digest"] == spec["checkpoint"]
    assert list(named["hosts"]) == job["report"]["nodes"]
    checkpoint = job["artifacts"]["checkpoint"]
    assert checkpoint["size"] > model_bytes  # the recalibrated model itself was written
    growth = peak[0] - before["VmRSS"]
    print(f"model {model_bytes >> 20} MiB; server RSS {before['VmRSS'] >> 20} -> peak {peak[0] >> 20} MiB "
          f"(VmHWM {before['VmHWM'] >> 20} -> {after['VmHWM'] >> 20} MiB)")
    assert growth < model_bytes // 4, f"the API process grew by {growth >> 20} MiB for a {model_bytes >> 20} MiB model"
    assert after["VmHWM"] - before["VmHWM"] < model_bytes // 4


def test_a_job_that_kills_the_host_fails_and_the_next_job_gets_a_fresh_host(server, tmp_path):
    samples = torch.randn(8, 4)
    samples[0, 0] = MARKER  # the probe on the first sample runs in the host: marker_net exits that process
    spec = {
        "arch": "tests.nets:marker_net",
        "checkpoint": upload(server.client, save_state(tmp_path / "m.pt", marker_net())),
        "data": upload(server.client, save_array(tmp_path / "marked.npy", samples)),
        "batch_size": 4, "order": "given",
    }
    killed = wait_for(server.client, submit(server.client, spec)["id"], timeout=120)
    assert killed["status"] == "failed"
    assert killed["error"]["type"] == "https://bnrecal.dev/problems/run"
    assert "the job host" in killed["error"]["detail"] and "died while running this job" in killed["error"]["detail"]
    assert server.process.poll() is None and server.client.get("/readyz").status_code == 200  # the server lives on
    spec["data"] = upload(server.client, save_array(tmp_path / "plain.npy", samples[1:]))
    fine = wait_for(server.client, submit(server.client, spec)["id"], timeout=120)
    assert fine["status"] == "succeeded", fine["error"]
    assert fine["report"]["samples"] == 7
