"""Recalibrating inside a training job: a 2-rank ``torch.distributed`` (GLOO) job, each rank
with its ``DistributedSampler`` shard of 515 samples whose mean drifts along the set, a small
CNN with dropout after each BN block. Three ways, side by side in the same job:

- ``update_bn`` on each rank (what Lightning's ``StochasticWeightAveraging`` and timm do under
  DDP): train-mode forwards, dropout on, each rank its own statistics;
- ``bnrecal.recalibrate(model, loader)`` on each rank, no group: exact, dropout off, but each
  rank its own data;
- ``bnrecal.recalibrate(model, loader, process_group=WORLD)``: exact over the job's ranks;
- Lightning's ``StochasticWeightAveraging`` BN epoch: a ``Trainer(strategy="ddp")`` on the
  same ranks and shards (the job's own group: Lightning sees the processes launched for it),
  one SWA epoch at learning rate 0 (the weights stay the model's) and then the BN epoch SWA
  adds, which runs ``training_step`` in train mode without backward; timed from that epoch's
  start to its end. Needs Lightning (``bnrecal[lightning]``), else the row is left out.

Each is held to the float64 statistics of every value each BN layer sees when the ranks'
step-t batches are normalised together (SyncBatchNorm's global batch), dropout off: the worst
layer's relative error of ``running_var`` and of ``running_mean`` (in std units) on rank 0,
how far the two ranks' ``running_var`` are apart, and each rank's wall time of the call
(the slower rank's, median of ``--rounds``). Target: the group's call no slower than
``update_bn`` on the same shards (at most 1.0x its wall time).

    .venv/bin/python bench/in_job.py [--rounds 3] [--samples 1030]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
BATCH = 32
METHODS = ("update_bn per rank", "Lightning SWA BN epoch", "bnrecal per rank", "bnrecal process_group")


def network() -> nn.Module:
    """A small CNN whose BN blocks are followed by dropout, as many classifiers' heads are."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    channels = 3
    for width in (16, 32, 32):
        blocks += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.Dropout(0.3)]
        channels = width
    model = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))
    for module in model.modules():  # stale statistics, as a trained model brought elsewhere has
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.fill_(0.5)
            module.running_var.fill_(2.0)
    return model.eval()


def data(samples: int) -> torch.Tensor:
    """Samples whose mean drifts along the set (a sampler's order matters)."""
    generator = torch.Generator().manual_seed(1)
    drift = torch.linspace(-1.0, 1.0, samples).view(-1, 1, 1, 1)
    return torch.randn(samples, 3, 32, 32, generator=generator) + drift


def rank_main(rank: int, world: int, port: int, out: str, samples: int, rounds: int) -> None:
    sys.path.insert(0, str(ROOT))
    import bnrecal

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    dataset = TensorDataset(data(samples))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    calls = {
        "update_bn per rank": lambda m: torch.optim.swa_utils.update_bn(loader, m),
        "bnrecal per rank": lambda m: bnrecal.recalibrate(m, loader, progress=False),
        "bnrecal process_group": lambda m: bnrecal.recalibrate(m, loader, process_group=dist.group.WORLD,
                                                              progress=False),
    }
    try:
        calls["Lightning SWA BN epoch"] = lambda m: swa_bn_epoch(m, loader, rank, world)
    except ImportError:
        pass
    results: dict[str, object] = {}
    import warnings

    warnings.simplefilter("ignore")  # bnrecal per rank warns that each rank recalibrates alone: that is the point
    for name, call in calls.items():
        times = []
        for _ in range(rounds):
            model = network()
            dist.barrier()
            started = time.perf_counter()
            seconds = call(model)
            times.append(seconds if isinstance(seconds, float) else time.perf_counter() - started)
        results[name] = {"seconds": times, "buffers": {k: v for k, v in model.state_dict().items() if "running" in k}}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def swa_bn_epoch(model: nn.Module, loader: DataLoader, rank: int, world: int) -> float:
    """Lightning's SWA on ``model`` in this rank of the job: one SWA epoch at learning rate 0,
    then SWA's BN epoch; the BN epoch's wall time. ``model`` ends with SWA's statistics."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))  # launched for it: no spawning

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            return self.model(batch[0]).logsumexp(dim=1).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class EpochClock(pl.Callback):
        def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.started = time.perf_counter()

        def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.seconds = time.perf_counter() - self.started  # the last epoch's: SWA's BN epoch

    model.train()  # as a module in training is (network() gives it in eval mode; the Trainer keeps the mode it finds)
    clock = EpochClock()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_epochs=1, use_distributed_sampler=False,
                         callbacks=[StochasticWeightAveraging(swa_lrs=1e-30, swa_epoch_start=1), clock],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Module(), loader)
    model.eval()
    return clock.seconds


def reference(samples: int, world: int) -> dict[str, torch.Tensor]:
    """Float64, dropout off, each step's global batch (the ranks' step-t batches together)
    normalised by its own statistics; every value each BN layer sees pooled."""
    dataset = TensorDataset(data(samples))
    shards = [[dataset[i][0] for i in DistributedSampler(dataset, world, rank, shuffle=False)] for rank in range(world)]
    steps = [torch.stack([x for shard in shards for x in shard[start:start + BATCH]])
             for start in range(0, max(map(len, shards)), BATCH)]
    model = copy.deepcopy(network()).double().eval()
    seen: dict[str, list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm2d):
            module.training = True
            module.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, []).append(
                args[0].transpose(0, 1).reshape(args[0].shape[1], -1)))
    with torch.no_grad():
        for step in steps:
            model(step.double())
    result = {}
    for name, chunks in seen.items():
        values = torch.cat(chunks, dim=1)
        result[f"{name}.running_mean"], result[f"{name}.running_var"] = values.mean(1), values.var(1, unbiased=True)
    return result


def errors(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Worst layer's relative running_var error and running_mean error in std units."""
    var = mean = 0.0
    for key, value in truth.items():
        if key.endswith("running_var"):
            var = max(var, ((got[key].double() - value) / value).abs().max().item())
        else:
            std = truth[key.replace("mean", "var")].sqrt()
            mean = max(mean, ((got[key].double() - value) / std).abs().max().item())
    return var, mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1030)
    args = parser.parse_args()
    world = 2
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {world} ranks x gloo, "
          f"{args.samples // world} samples each, batch {BATCH}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(world, port, out, args.samples, args.rounds), nprocs=world, join=True)
        ranks = [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    truth = reference(args.samples, world)
    baseline = statistics.median(max(r["update_bn per rank"]["seconds"][i] for r in ranks) for i in range(args.rounds))
    print(f"{'method':24s} {'var err':>9s} {'mean err':>9s} {'ranks apart':>11s} {'wall s':>7s} {'vs update_bn':>12s}")
    for name in (name for name in METHODS if name in ranks[0]):
        var, mean = errors(ranks[0][name]["buffers"], truth)
        apart = max((((ranks[0][name]["buffers"][k].double() - ranks[1][name]["buffers"][k].double())
                      / truth[k]).abs().max().item()) for k in truth if k.endswith("running_var"))
        wall = statistics.median(max(r[name]["seconds"][i] for r in ranks) for i in range(args.rounds))
        print(f"{name:24s} {var:9.2%} {mean:9.4f} {apart:11.2%} {wall:7.3f} {wall / baseline:11.2f}x")
    print(f"after: load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
