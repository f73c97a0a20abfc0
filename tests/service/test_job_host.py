"""The job host keeps a job's model out of the API process: a real ``bnrecal serve`` runs a
resnet50 job (~100 MB of weights) and its own memory barely moves, while the job's model
is loaded, probed, recalibrated and written in the host actor."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.api.conftest import submit, upload, wait_for
from tests.api.server_process import ServerProcess, servers  # noqa: F401 - servers is a fixture


def memory(pid: int) -> dict[str, int]:
    """A process's resident set now (VmRSS) and at its peak (VmHWM), in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


@pytest.mark.slow  # a server start and a resnet50 job: ~40 s on a busy 2-core machine
def test_a_large_model_never_lives_in_the_api_process(servers, tmp_path):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    torch.save(model.state_dict(), tmp_path / "resnet50.pt")
    del model
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).normal(size=(4, 3, 32, 32)).astype(np.float32))

    server = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    servers.append(server)
    spec = {
        "arch": "torchvision:resnet50",
        "checkpoint": upload(server.client, tmp_path / "resnet50.pt"),
        "data": upload(server.client, tmp_path / "calib.npy"),
        "workers": 1,
        "batch_size": 4,
    }
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
    checkpoint = job["artifacts"]["checkpoint"]
    assert checkpoint["size"] > model_bytes  # the recalibrated model itself was written
    growth = peak[0] - before["VmRSS"]
    print(f"model {model_bytes >> 20} MiB; server RSS {before['VmRSS'] >> 20} -> peak {peak[0] >> 20} MiB "
          f"(VmHWM {before['VmHWM'] >> 20} -> {after['VmHWM'] >> 20} MiB)")
    assert growth < model_bytes // 4, f"the API process grew by {growth >> 20} MiB for a {model_bytes >> 20} MiB model"
    assert after["VmHWM"] - before["VmHWM"] < model_bytes // 4
