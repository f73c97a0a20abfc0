"""The INT8 export's own computing on the ranks (``service.run.outputs.int8`` through
``workers.ranks.offload``): onnxruntime's pre-processing, the entropy search, the quantizer
and the file's checks run in the ranks' processes, none of it on the job's host, and the
file and its section are byte for byte those of the same export in one process."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
import torch

from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.run.outputs import int8
from bnrecal.service.run.executors import on_ranks
from bnrecal.service.run.outputs.onnx_passes import InProcessPasses
from bnrecal.service.settings import Settings
from tests.service.export.int8_helpers import array_dataset, fp32_export

HOST_WORK = ("prepare", "tensors_data", "write_qdq", "check_int8", "latency_ms", "graph_summary")
"""What the INT8 export computes between its passes: on the ranks, never on the host."""

WHERE = {"latency_ms", "range_seconds", "world_size", "collectives"}  # timed, or where the passes ran


def refused_here(original, host: int):
    """``original``, except in the process ``host`` (the test's own, the job's host)."""
    def guarded(*args, **kwargs):
        if os.getpid() == host:
            raise AssertionError(f"{original.__name__} ran on the job's host")
        return original(*args, **kwargs)

    return guarded


@pytest.mark.parametrize("method", ["entropy"])
def test_the_quantizer_runs_on_the_ranks_and_writes_the_same_file(tmp_path, warm_pool, monkeypatch, method):
    torch.manual_seed(0)
    model = torch.nn.Sequential(  # small: onnxruntime's entropy search takes seconds a tensor
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10),
    ).eval()
    samples = torch.randn(40, 3, 16, 16)
    fp32 = fp32_export(model, samples, tmp_path / "fp32.onnx")
    dataset = array_dataset(tmp_path / "x.npy", samples)
    options = Int8Options(method=method)

    here = int8.quantize_export(fp32, options, InProcessPasses(dataset, 16), samples[:8])

    for name in HOST_WORK:
        monkeypatch.setattr(int8, name, refused_here(getattr(int8, name), os.getpid()))
    passes = on_ranks(dataset, 16, 2, "cpu", Settings(cpus_per_worker=1), pool=warm_pool)
    there = int8.quantize_export(fp32, options, passes, samples[:8])

    assert there.model == here.model
    assert there.section.model_dump(exclude=WHERE) == here.section.model_dump(exclude=WHERE)
    assert (there.section.world_size, there.section.collectives) == (2, [2, 2]) and passes.work_seconds > 0
    assert there.section.latency_ms.batch == 1 and min(there.section.latency_ms.fp32, there.section.latency_ms.int8) > 0


class _Recording(InProcessPasses):
    """This process's passes, keeping in ``ran`` the work each map ran and its calls."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.ran: list[tuple[str, int]] = []

    def _map(self, work, calls):
        self.ran.append((work.__name__, len(calls)))
        return super()._map(work, calls)


class _TwoMachines(_Recording):
    """Answers each file's timing as from its own machine, as two ranks on two machines would."""

    def _map(self, work, calls):
        results = super()._map(work, calls)
        if work is int8.time_file:
            results = [dataclasses.replace(timed, machine=f"node-{i}") for i, timed in enumerate(results)]
        return results


def test_files_timed_on_two_machines_are_timed_again_on_one(tmp_path):
    """Side by side the two latencies come from two ranks: where those ranks' machines differ
    (their CPUs may), both files are timed again one after the other on one rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten()).eval()
    samples = torch.randn(8, 3, 6, 6)
    fp32 = fp32_export(model, samples, tmp_path / "fp32.onnx")
    passes = _TwoMachines(array_dataset(tmp_path / "x.npy", samples), 4)

    latency = int8.file_latency(passes, fp32, fp32, samples[:1].numpy())

    assert passes.ran == [("time_file", 2), ("time_files", 1)]
    assert latency.batch == 1 and latency.fp32 > 0 and latency.int8 > 0
    one_machine = _Recording(array_dataset(tmp_path / "y.npy", samples), 4)
    int8.file_latency(one_machine, fp32, fp32, samples[:1].numpy())
    assert one_machine.ran == [("time_file", 2)]


def dies_once(marker: str) -> int:
    """Kills its own process the first time (``marker`` not yet there), else answers its pid."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid()


def test_a_rank_lost_in_the_quantizers_work_runs_that_work_again(tmp_path, warm_pool):
    """A rank killed while it runs a piece of the INT8 export's work: the piece runs again on
    a fresh gang under the run's failure policy (the passes before it are not redone), the
    failure names the rank, and the progress says so."""
    from bnrecal.service.run.core import FailurePolicy, RunControl

    dataset = array_dataset(tmp_path / "x.npy", torch.randn(8, 3, 8, 8))
    control = RunControl(FailurePolicy(max_retries=1))
    failures = control.failures
    phases: list[str] = []
    passes = on_ranks(dataset, 4, 2, "cpu", Settings(cpus_per_worker=1), pool=warm_pool,
                      control=control, on_phase=phases.append)
    pids = passes.map(dies_once, [(str(tmp_path / "a"),), (str(tmp_path / "b"),)])
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert len(failures) == 1 and "rank 0 died in a later phase's work" in failures[0], failures
    assert phases == [f"running the later phase's work again after: {failures[0]}"]
