"""``bnrecal.recalibrate(..., process_group=group)`` inside a real ``torch.distributed`` job:
2 and 3 processes on GLOO, each with its own shard (uneven), its own DataLoader or the same
Dataset; every rank ends with the same statistics and report, those of one process over the
ranks' batches put together step by step; a rank that fails makes the others fail, never hang.

Each spawn runs several cases in turn on one group (a process importing torch costs seconds);
the ranks write what they got to files the test compares."""

from __future__ import annotations

import copy
import datetime
import os
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

import bnrecal
from bnrecal.errors import SpecError

from tests.nets import mixed_net, perturbed

BATCH = 8
TIMEOUT_S = 20  # the group's collective timeout: how long a rank waits for one that died mid-pass


def model() -> torch.nn.Module:
    torch.manual_seed(6)
    return perturbed(mixed_net()).eval()


def samples() -> torch.Tensor:
    return torch.randn(120, 3, 6, 5, generator=torch.Generator().manual_seed(1)) * 1.3 + 0.2


def shard(rank: int, world: int, sizes: tuple[int, ...]) -> torch.Tensor:
    """Rank ``rank``'s shard: every world-th sample (as a DistributedSampler deals them), cut to its size."""
    return samples()[rank::world][: sizes[rank]]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value for key, value in module.state_dict().items() if "running" in key or "tracked" in key}


def _rank(rank: int, world: int, port: int, out: str, sizes: tuple[int, ...], cases: tuple[str, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    group, results = dist.group.WORLD, {}
    mine = shard(rank, world, sizes)
    for case in cases:
        live = copy.deepcopy(model())
        try:
            if case == "loader":
                report = bnrecal.recalibrate(live, DataLoader(TensorDataset(mine), batch_size=BATCH), process_group=group,
                                             progress=False)
            elif case == "stale buffers differ":  # as DDP leaves them after training: each rank's own
                with torch.no_grad():
                    for name, buffer in live.named_buffers():
                        if name.endswith("running_mean"):
                            buffer.add_(3.0 * rank + 0.5)
                report = bnrecal.recalibrate(live, DataLoader(TensorDataset(mine), batch_size=BATCH), process_group=group,
                                             progress=False)
            elif case == "ddp":
                wrapped = torch.nn.parallel.DistributedDataParallel(live)
                report = bnrecal.recalibrate(wrapped, DataLoader(TensorDataset(mine), batch_size=BATCH),
                                             process_group=group, progress=False)
            elif case == "batches":  # any iterable of batches, this rank's own
                report = bnrecal.recalibrate(live, [mine[i:i + BATCH] for i in range(0, len(mine), BATCH)],
                                             process_group=group, progress=False)
            elif case == "local":
                report = bnrecal.recalibrate(live, DataLoader(TensorDataset(mine), batch_size=BATCH), mode="local",
                                             process_group=group, progress=False)
            elif case == "auto":
                report = bnrecal.recalibrate(live, DataLoader(TensorDataset(mine), batch_size=2), max_samples="auto",
                                             tolerance=0.3, process_group=group, progress=False)
            elif case == "dataset":  # the same Dataset on every rank: split between them
                report = bnrecal.recalibrate(live, TensorDataset(samples()[:100]), batch_size=10, process_group=group,
                                             progress=False)
            elif case == "bad data on rank 1":
                data = mine if rank != 1 else torch.randn(16, 4, 6, 5)  # four channels: the model takes three
                report = bnrecal.recalibrate(live, data, batch_size=BATCH, process_group=group, progress=False)
            elif case == "dies mid-pass on rank 1":
                if rank == 1:
                    calls = iter(range(1000))
                    live.register_forward_pre_hook(lambda *_: None if next(calls) < 2 else 1 / 0)
                report = bnrecal.recalibrate(live, DataLoader(TensorDataset(mine), batch_size=BATCH), process_group=group,
                                             progress=False)
            elif case == "accelerate":  # Hugging Face Accelerate on the job's group: its model and sharded loader
                from accelerate import Accelerator

                os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                  LOCAL_WORLD_SIZE=str(world))
                accelerator = Accelerator(cpu=True)
                prepared, loader = accelerator.prepare(live, DataLoader(TensorDataset(samples()[:96]), batch_size=BATCH))
                seen = [batch[0] for batch in loader]  # this rank's batches, as Accelerate deals them
                report = bnrecal.recalibrate(prepared, loader, process_group=group, progress=False)
                results[case] = {"buffers": buffers(live), "report": report.to_dict(), "seen": seen,
                                 "wrapped": type(prepared).__name__}
                continue
            elif case == "refusals":
                refused = []
                for extra in ({"workers": 2}, {"ray_address": "auto"}, {"server": "http://x"}):
                    try:
                        bnrecal.recalibrate(live, mine, batch_size=BATCH, process_group=group, **extra)
                    except SpecError as error:
                        refused.append(error.field)
                with warnings.catch_warnings(record=True) as warned:
                    warnings.simplefilter("always")
                    bnrecal.recalibrate(live, mine, batch_size=BATCH, progress=False)  # no group: this rank alone
                results[case] = {"refused": refused, "warned": [str(w.message) for w in warned]}
                continue
            results[case] = {"buffers": buffers(live), "report": report.to_dict()}
        except Exception as error:  # noqa: BLE001 - what each rank raised is the result
            results[case] = {"error": f"{type(error).__name__}: {error}"}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()
    if "dies mid-pass on rank 1" in cases:
        # After a peer closed its connection mid-collective, torch's gloo may abort this process at
        # interpreter teardown ("terminate called without an active exception", any rank, about one
        # run in six, after every rank has written its results): leave without running C++ teardown.
        os._exit(0)


def run_group(tmp_path: Path, sizes: tuple[int, ...], cases: tuple[str, ...]) -> list[dict[str, Any]]:
    world = len(sizes)
    mp.spawn(_rank, args=(world, free_port(), str(tmp_path), sizes, cases), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def steps_together(world: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """Every step's global batch: the ranks' step-t batches put together."""
    shards = [shard(rank, world, sizes) for rank in range(world)]
    return [torch.cat([s[start:start + BATCH] for s in shards if start < len(s)])
            for start in range(0, max(sizes), BATCH)]


def single_process(data: Any, **options: Any) -> dict[str, torch.Tensor]:
    one = copy.deepcopy(model())
    bnrecal.recalibrate(one, data, progress=False, **options)
    return buffers(one)


def assert_same_on_every_rank(results: list[dict[str, Any]], case: str) -> dict[str, Any]:
    first = results[0][case]
    assert "error" not in first, first
    for other in results[1:]:
        assert other[case]["report"] == first["report"], case
        assert all(torch.equal(first["buffers"][key], value) for key, value in other[case]["buffers"].items()), case
    return first


def assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    for key, value in expected.items():
        if "tracked" in key:
            assert torch.equal(got[key], value), key
            continue
        scale = value.double().abs().max().clamp_min(1e-12)
        assert ((got[key].double() - value.double()).abs().max() / scale) <= rel, key


def test_two_ranks_of_a_gloo_job_end_with_the_statistics_of_their_steps_put_together(tmp_path):
    sizes = (56, 37)  # uneven shards: rank 1 runs out two steps early
    cases = ("loader", "stale buffers differ", "ddp", "batches", "local", "auto", "dataset", "refusals",
             "bad data on rank 1", "accelerate")
    results = run_group(tmp_path, sizes, cases)
    together = steps_together(2, sizes)

    loader = assert_same_on_every_rank(results, "loader")
    assert (loader["report"]["samples"], loader["report"]["steps"]) == (93, 7)
    assert (loader["report"]["world_size"], loader["report"]["backend"]) == (2, "torch.distributed:gloo")
    assert_close(loader["buffers"], single_process(together))
    assert_close(loader["buffers"], _as_buffers(_pooled_reference(together)), rel=1e-4)  # independent of the engine
    for case in ("ddp", "batches"):
        assert_close(assert_same_on_every_rank(results, case)["buffers"], loader["buffers"], rel=0)
    # the stale buffers only steady the sums (their shift): the ranks agree on one, whatever each holds
    assert_close(assert_same_on_every_rank(results, "stale buffers differ")["buffers"], loader["buffers"])

    # local mode: each rank's step normalised alone, combined once at the end (equal steps here but the last)
    local = assert_same_on_every_rank(results, "local")
    own_steps = [s[start:start + BATCH] for s in (shard(rank, 2, sizes) for rank in range(2))
                 for start in range(0, len(s), BATCH)]
    assert_close(local["buffers"], _as_buffers(_pooled_reference(own_steps)), rel=1e-4)

    auto = assert_same_on_every_rank(results, "auto")["report"]
    assert auto["convergence"]["converged"] and auto["samples"] < 93

    dataset = assert_same_on_every_rank(results, "dataset")
    assert dataset["report"]["samples"] == 100
    assert_close(dataset["buffers"], single_process(TensorDataset(samples()[:100]), batch_size=10))

    accelerate = assert_same_on_every_rank(results, "accelerate")
    assert results[0]["accelerate"]["wrapped"] == "DistributedDataParallel"
    seen = [results[rank]["accelerate"]["seen"] for rank in (0, 1)]
    assert [len(batches) for batches in seen] == [6, 6]  # 96 samples, batches of 8, dealt between the ranks
    assert accelerate["report"]["samples"] == 96
    assert_close(accelerate["buffers"], single_process([torch.cat(step) for step in zip(*seen, strict=True)]))

    for rank in (0, 1):
        assert results[rank]["refusals"]["refused"] == ["process_group"] * 3
        assert any("no process_group" in message for message in results[rank]["refusals"]["warned"])
    assert "the model rejects" in results[1]["bad data on rank 1"]["error"] or "channels" in results[1]["bad data on rank 1"]["error"]
    assert results[0]["bad data on rank 1"]["error"].startswith("RunError: rank 1 of the process group failed before the pass")


def test_three_uneven_ranks_agree_and_a_rank_that_dies_mid_pass_fails_the_others(tmp_path):
    sizes = (40, 17, 3)  # rank 2 has one short step, rank 1 three
    results = run_group(tmp_path, sizes, ("loader", "dies mid-pass on rank 1"))
    loader = assert_same_on_every_rank(results, "loader")
    assert (loader["report"]["samples"], loader["report"]["steps"], loader["report"]["world_size"]) == (60, 5, 3)
    assert_close(loader["buffers"], single_process(steps_together(3, sizes)))
    died = [results[rank]["dies mid-pass on rank 1"].get("error", "") for rank in range(3)]
    assert died[1].startswith("ZeroDivisionError") or "division by zero" in died[1]
    assert all(died[rank] for rank in (0, 2)), died  # failed at the group's timeout, not hung


def _as_buffers(statistics: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    values = {}
    for name, (mean, var) in statistics.items():
        values[f"{name}.running_mean"], values[f"{name}.running_var"] = mean.float(), var.float()
    return values


def _pooled_reference(batches: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The statistics, independently of the engine: each batch normalised by its own statistics
    (float64, each BN module's own train-mode forward), every value any BN layer saw pooled."""
    seen: dict[str, list[torch.Tensor]] = {}
    for batch in batches:
        for name, values in _layer_inputs(batch).items():
            seen.setdefault(name, []).append(values)
    pooled = {name: torch.cat(chunks, dim=1) for name, chunks in seen.items()}
    return {name: (values.mean(dim=1), values.var(dim=1, unbiased=True)) for name, values in pooled.items()}


def _layer_inputs(batch: torch.Tensor) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model()).double().eval()
    seen: dict[str, torch.Tensor] = {}
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.training = True
            module.register_forward_pre_hook(
                lambda mod, args, name=name: seen.__setitem__(name, args[0].transpose(0, 1).reshape(args[0].shape[1], -1))
            )
    with torch.no_grad():
        reference(batch.double())
    return seen


pytestmark = pytest.mark.timeout(600)


def _nccl_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    live = copy.deepcopy(model()).cuda()
    loader = DataLoader(TensorDataset(shard(0, 1, (40,))), batch_size=BATCH)
    report = bnrecal.recalibrate(live, loader, device="cuda", process_group=dist.group.WORLD, progress=False)
    torch.save({"buffers": {k: v.cpu() for k, v in buffers(live).items()}, "report": report.to_dict()},
               Path(out) / "nccl.pt")
    dist.destroy_process_group()


@pytest.mark.gpu
def test_an_nccl_group_combines_on_the_ranks_cuda_device(tmp_path):
    """The NCCL path (moments cross on the rank's CUDA device), in a world of one: a GPU
    machine here has one device, and NCCL takes one rank per device."""
    mp.spawn(_nccl_rank, args=(free_port(), str(tmp_path)), nprocs=1, join=True)
    got = torch.load(tmp_path / "nccl.pt", weights_only=False)
    assert got["report"]["backend"] == "torch.distributed:nccl" and got["report"]["samples"] == 40
    steps = [shard(0, 1, (40,))[start:start + BATCH] for start in range(0, 40, BATCH)]
    assert_close(got["buffers"], _as_buffers(_pooled_reference(steps)), rel=1e-4)
