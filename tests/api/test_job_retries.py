"""A server job rides out a lost rank (docs/calibration.md, "Faults and retries"): with no
``max_retries`` in its spec it is retried once, the retry gives the bytes of a run that
never failed, and the job says it was retried and why; with ``max_retries: 0`` it fails
naming the rank."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.api.conftest import LiveServer, submit, upload, wait_for
from tests.api.test_storage import client_of, serve
from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net


@pytest.fixture(scope="module")
def live(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server of default settings for the module's jobs: the ranks are what is lost here,
    not the server (a rank lost on a warm gang is lost all the same)."""
    with serve(tmp_path_factory.mktemp("retries")) as server:
        yield server


def inputs(client: httpx.Client, tmp_path: Path) -> dict[str, str]:
    """A marker_net checkpoint and 16 samples whose last is marked, uploaded once."""
    torch.manual_seed(0)
    samples = torch.randn(16, 4)
    samples[15, 0] = MARKER  # not sample 0: the driver's probe forward must not sleep
    return {
        "checkpoint": upload(client, save_state(tmp_path / "m.pt", marker_net())),
        "data": upload(client, save_array(tmp_path / "x.npy", samples)),
    }


def hanging_job(uploaded: dict[str, str], signals: Path, **extra) -> dict:
    """Two ranks; the rank holding the marked sample sleeps 3 s in its second step (and
    leaves ``hanging-<pid>`` in ``signals``), the other waits for it in the collective."""
    kwargs = {"action": "hang", "hang_s": 3.0, "signal_dir": str(signals)}
    return {"arch": "tests.nets:marker_net", "model_kwargs": kwargs, "workers": 2, "batch_size": 8,
            "order": "given", **uploaded, **extra}


def kill_the_hanging_rank(signals: Path) -> None:
    deadline = time.monotonic() + 120
    while not list(signals.glob("hanging-*")):
        assert time.monotonic() < deadline, "no rank reached the marked sample"
        time.sleep(0.05)
    os.kill(int(next(signals.glob("hanging-*")).name.split("-")[1]), signal.SIGKILL)


def test_a_lost_rank_is_retried_once_by_default_and_the_job_says_so(live, tmp_path):
    signals = tmp_path / "signals"
    signals.mkdir()
    with client_of(live) as client:
        uploaded = inputs(client, tmp_path)
        (tmp_path / "unused").mkdir()
        clean = wait_for(client, submit(client, hanging_job(uploaded, tmp_path / "unused"))["id"], timeout=240)
        job = submit(client, hanging_job(uploaded, signals))
        kill_the_hanging_rank(signals)
        done = wait_for(client, job["id"], timeout=240)
        assert done["status"] == "succeeded", done["error"]
        assert done["report"]["attempts"] == 2, done["report"]["attempts"]
        assert "died" in done["report"]["retried_failures"][0]
        assert any(p["phase"].startswith("starting workers again after: rank") for p in done["phases"])
        ours = client.get(f"/v1/jobs/{done['id']}/artifacts/checkpoint").content
        theirs = client.get(f"/v1/jobs/{clean['id']}/artifacts/checkpoint").content
        assert ours == theirs  # the retry gives the very bytes of a run that never failed


def test_max_retries_0_fails_the_job_naming_the_rank(live, tmp_path):
    signals = tmp_path / "signals"
    signals.mkdir()
    with client_of(live) as client:
        job = submit(client, hanging_job(inputs(client, tmp_path), signals, max_retries=0))
        kill_the_hanging_rank(signals)
        done = wait_for(client, job["id"], timeout=240)
        assert done["status"] == "failed"
        assert "rank" in done["error"]["detail"] and done["error"].get("rank") is not None
