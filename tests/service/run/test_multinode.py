"""bnrecal on a real two-node Ray cluster (two raylets on loopback), driven by the CLI.

The data reaches the ranks through the object store (a multi-node cluster is not
assumed to share the driver's files), one rank per node (strict spread).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net, mixed_net, perturbed
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics

pytestmark = pytest.mark.slow


LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Ray's switch that makes every process (raylets, driver) take 127.0.0.1 as its node
address: the test cluster's traffic stays on loopback."""


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[tuple[object, object]]:
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in LOOPBACK_ONLY.items():
            patch.setenv(name, value)  # for the raylets' own worker processes
        cluster = Cluster(initialize_head=True, connect=False, head_node_args=node)
        worker = cluster.add_node(**node)
        cluster.wait_for_nodes()
    yield cluster, worker
    cluster.shutdown()


def cli(address: str, *args: str, **popen: object) -> subprocess.Popen[str]:
    env = {**os.environ, **LOOPBACK_ONLY, "BNRECAL_MODEL_MODULES": "tests", "PYTHONPATH": str(Path(__file__).parents[3])}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "bnrecal"), "calibrate", "--ray-address", address, *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
    )


def test_one_rank_per_node_matches_the_reference(two_nodes, tmp_path):
    cluster, _ = two_nodes
    torch.manual_seed(5)
    model = perturbed(mixed_net())
    samples = torch.randn(21, 3, 6, 5)
    checkpoint, data = save_state(tmp_path / "m.pt", model), save_array(tmp_path / "x.npy", samples.numpy())
    process = cli(
        cluster.address, "--arch", "tests.nets:mixed_net", "--checkpoint", str(checkpoint), "--data", str(data),
        "--workers", "2", "--batch-size", "8", "--placement", "strict_spread",
        "--out", str(tmp_path / "out.pt"), "--report", str(tmp_path / "report.json"),
    )
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert cluster.address.startswith("127.0.0.1:")
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(set(report["nodes"])) == 2
    assert report["data_transport"] == "object_store" and report["placement"] == "STRICT_SPREAD"
    recalibrated = mixed_net()
    recalibrated.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True))
    # The K=1 result is the reference within the documented tolerance (docs/calibration.md,
    # "Accuracy"; tests/service/run/test_recalibrate.py).
    assert_matches_reference(recalibrated, reference_statistics(model, in_contract_order(samples), 8))


def test_losing_a_node_fails_the_job_naming_it(two_nodes, tmp_path):
    cluster, worker = two_nodes
    samples = torch.randn(16, 4)
    samples[1:, 0] = MARKER  # every rank hangs in its first step (sample 0 is the driver's shape probe)
    checkpoint, data = save_state(tmp_path / "m.pt", marker_net()), save_array(tmp_path / "x.npy", samples.numpy())
    signals = tmp_path / "signals"
    signals.mkdir()
    kwargs = json.dumps({"action": "hang", "signal_dir": str(signals)})
    process = cli(
        cluster.address, "--arch", "tests.nets:marker_net", "--model-kwargs", kwargs, "--checkpoint", str(checkpoint),
        "--data", str(data), "--workers", "2", "--batch-size", "4", "--placement", "strict_spread",
        "--order", "given",  # sample 0 (the driver's probe) is the file's first row
        "--out", str(tmp_path / "never.pt"),
    )
    deadline = time.monotonic() + 180
    while len(list(signals.iterdir())) < 2:
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.5)
    started = time.monotonic()
    cluster.remove_node(worker)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1, err
    assert time.monotonic() - started < 60
    line = err.strip().splitlines()[-1]
    assert "died" in line and worker.node_id[:12] in line, line
    assert not (tmp_path / "never.pt").exists()
