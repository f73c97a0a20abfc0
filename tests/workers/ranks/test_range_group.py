"""INT8 ranges gathered by real Ray ranks: the same file, byte for byte, for K = 1, 2, 4
(one rank with an empty shard at the last step), equal to the one-process result, one
collective per pass on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision

from bnrecal.workers.ranks.group import GroupOptions
from bnrecal.workers.ranks.int8_ranges import RangeRequest
from bnrecal.workers.ranks.range_group import run_range_group

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.int8.quantizer import prepare, tensors_data, write_qdq
from bnrecal.service.run.ranges import in_process
from tests.service.export.int8_helpers import array_dataset, fp32_export

SAMPLES, BATCH = 41, 16  # the last step has one sample: ranks 1..K-1 take an empty slice


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_int8_file_is_byte_identical_for_any_number_of_ranks(tmp_path, warm_pool, method):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    samples = torch.randn(SAMPLES, 3, 24, 24)
    prepared = prepare(fp32_export(model, samples, tmp_path / "fp32.onnx"))
    dataset = array_dataset(tmp_path / "x.npy", samples)
    options = Int8Options(method=method)
    request = RangeRequest(prepared.tensors, method, options.histogram_bins() if method != "minmax" else 0,
                           options.absolute)

    def file_of(gathered) -> bytes:
        result = gathered.result
        return write_qdq(prepared, tensors_data(result.ranges, result.histograms, result.edges, options), options, [])

    here = in_process(dataset, BATCH)(prepared.model, request)
    files = {0: file_of(here)}
    passes = 1 if method == "minmax" else 2
    for world in (1, 2, 4):
        gathered = run_range_group(
            prepared.model, request, dataset, BATCH, world, "cpu", "gloo", GroupOptions(cpus_per_worker=1),
            pool=warm_pool,
        )
        assert gathered.collectives == [passes] * world
        assert sum(gathered.samples) == SAMPLES
        assert np.array_equal(gathered.result.ranges.low, here.result.ranges.low)
        if here.result.histograms is not None:
            assert np.array_equal(gathered.result.histograms, here.result.histograms)
        files[world] = file_of(gathered)
    assert len(set(files.values())) == 1


def _gathering_rank_pids() -> set[int]:
    """Rank processes now running a range pass (Ray titles an actor process by its method)."""
    import psutil

    pids = set()
    for process in psutil.process_iter(["cmdline"]):
        if any("CalibrationRank.onnx_pass" in part for part in process.info["cmdline"] or []):
            pids.add(process.pid)
    return pids


def test_a_rank_lost_in_the_range_pass_reruns_that_pass_only_and_gives_the_same_ranges(tmp_path, ray_cluster):
    """A rank killed while it gathers INT8 ranges: the pass runs again under the run's failure
    policy (the calibration before it is not redone: this is the range pass alone), the
    ranges equal those of a pass that never failed, and the failure named its rank."""
    import os
    import signal
    import threading
    import time

    from bnrecal.service.run.executors import on_ranks
    from bnrecal.service.run.core import FailurePolicy
    from bnrecal.service.settings import Settings

    torch.manual_seed(1)
    model = torchvision.models.resnet18(num_classes=10)
    samples = torch.randn(480, 3, 64, 64)
    prepared = prepare(fp32_export(model, samples, tmp_path / "fp32.onnx"))
    dataset = array_dataset(tmp_path / "x.npy", samples)
    request = RangeRequest(prepared.tensors, "minmax", 0, False)
    clean = in_process(dataset, 8)(prepared.model, request)

    failures: list[str] = []
    phases: list[str] = []
    gather = on_ranks(dataset, 8, 2, "cpu", Settings(cpus_per_worker=1), policy=FailurePolicy(max_retries=1),
                      failures=failures, on_phase=phases.append)
    outcome: dict = {}
    worker = threading.Thread(target=lambda: outcome.update(result=gather(prepared.model, request)))
    worker.start()
    deadline = time.monotonic() + 120
    while not _gathering_rank_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the ranks are gathering
    victim = sorted(_gathering_rank_pids())[0]
    os.kill(victim, signal.SIGKILL)
    worker.join(timeout=300)
    assert "result" in outcome, "the range pass did not come back"
    assert len(failures) == 1 and "rank" in failures[0] and "INT8 ranges" in failures[0], failures
    assert phases and phases[0].startswith("collecting INT8 ranges again after: rank")
    assert np.array_equal(outcome["result"].result.ranges.low, clean.result.ranges.low)
    assert np.array_equal(outcome["result"].result.ranges.high, clean.result.ranges.high)
