"""The cached view of the cluster on the session's real Ray: fresh answers make it reachable;
an answer that stops coming (a Ray call that blocks, as on a dead GCS) makes it unreachable
within 2 s without anything on the request path waiting; an embedded GCS process that exited
is told at once and to the listeners once. (The whole path with a real killed GCS is
``tests/api/test_ray_loss.py``.)"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from bnrecal.service.jobserver.cluster.capacity import cluster_nodes
from bnrecal.service.jobserver.cluster.health import STALE_AFTER_S, ClusterHealth
from bnrecal.errors import ServiceUnavailableError

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_a_cluster_that_answers_is_reachable_with_its_nodes():
    health = ClusterHealth()
    health.start()
    try:
        state = health.require()
        assert state.reachable and state.nodes and state.cpus == sum(node.cpus for node in cluster_nodes())
    finally:
        health.stop()


def test_a_cluster_whose_calls_block_turns_unreachable_within_two_seconds_and_nothing_waits_on_it():
    blocked = threading.Event()

    def ask():
        if blocked.is_set():
            time.sleep(60)  # as ray.nodes() does on a dead GCS
        return cluster_nodes()

    health = ClusterHealth(ask=ask)
    health.start()
    try:
        assert health.state().reachable
        blocked.set()
        began = time.monotonic()
        while health.state().reachable:
            time.sleep(0.02)
        assert time.monotonic() - began < 2.0
        assert "has not answered for" in health.state().reason
        asked = time.monotonic()
        with pytest.raises(ServiceUnavailableError, match="Ray cluster is unreachable"):
            health.require(wait_s=0.3)
        assert time.monotonic() - asked < 0.3 + STALE_AFTER_S
    finally:
        health.stop()


def test_an_embedded_gcs_that_exits_is_told_at_once_and_once():
    gcs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    told: list[str] = []
    health = ClusterHealth(embedded_gcs=gcs)
    health.on_lost(told.append)
    health.start()
    try:
        assert health.state().reachable
        gcs.kill()
        gcs.wait()
        assert not health.state().reachable and "GCS process exited" in health.state().reason
        deadline = time.monotonic() + 2
        while not told and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        assert len(told) == 1 and "GCS process exited (code -9)" in told[0]
    finally:
        health.stop()
        if gcs.poll() is None:
            gcs.kill()
