"""``bnrecal.lightning.BNRecalibration`` in real Lightning Trainers: after SWA on one CPU
device and under ``ddp_spawn`` on two, its statistics are those of one process over the
Trainer's own batches (on two ranks: the ranks' step batches put together); gated on
evaluation data; for ``pytorch_lightning`` too; never loaded by ``import bnrecal``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bnrecal

lightning = pytest.importorskip("lightning", reason="the lightning extra is part of the test extras")
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from lightning.pytorch.callbacks import StochasticWeightAveraging  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from bnrecal.lightning import BNRecalibration  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SAMPLES, BATCH = 96, 8


class Classifier(LightningModule):
    """A small CNN with BN and dropout, trained a little on two separable classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, _index):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def dataset(shift: float = 0.0, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(SAMPLES) % 2
    x = torch.randn(SAMPLES, 3, 8, 8, generator=generator) + (labels.view(-1, 1, 1, 1) * 2.0 - 1.0) + shift
    return TensorDataset(x, labels)


def bn_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in module.state_dict().items() if "running" in key}


def trainer(tmp_path: Path, callbacks: list, **kwargs) -> Trainer:
    return Trainer(accelerator="cpu", max_epochs=2, callbacks=callbacks, logger=CSVLogger(tmp_path),
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kwargs)


def assert_equal_buffers(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    for key, value in expected.items():
        assert ((got[key] - value).abs().max() / value.abs().max().clamp_min(1e-12)) <= rel, key


def test_after_swa_on_one_device_the_module_has_bnrecals_statistics_of_the_train_loader(tmp_path):
    module, callback = Classifier(), BNRecalibration()
    loader = DataLoader(dataset(), batch_size=BATCH)
    trainer(tmp_path, [StochasticWeightAveraging(swa_lrs=0.01), callback], devices=1).fit(module, loader)
    got = bn_buffers(module)
    again = copy.deepcopy(module)
    bnrecal.recalibrate(again, loader, progress=False)  # the same final weights, the same batches
    assert_equal_buffers(got, bn_buffers(again), rel=0)
    assert callback.report is not None and callback.report["samples"] == SAMPLES
    written = json.loads(next(tmp_path.rglob("bnrecal-report.json")).read_text())
    assert written["samples"] == SAMPLES and written["steps"] == SAMPLES // BATCH
    logged = next(tmp_path.rglob("metrics.csv")).read_text()
    assert "bnrecal/samples" in logged and "bnrecal/mean_shift_max" in logged


class Record(lightning.pytorch.Callback):
    """After the recalibration, each rank's batches of the train dataloader (in this epoch's
    order, as the callback read them) and the module's state, to files."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        batches = [batch[0] for batch in trainer.train_dataloader]
        torch.save({"batches": batches, "state": pl_module.state_dict()}, self.folder / f"rank{trainer.global_rank}.pt")


def test_under_ddp_spawn_the_ranks_recalibrate_together_on_their_shards(tmp_path):
    module = Classifier()
    loader = DataLoader(dataset(), batch_size=BATCH)
    trainer(tmp_path, [StochasticWeightAveraging(swa_lrs=0.01), BNRecalibration(), Record(tmp_path)], devices=2,
            strategy="ddp_spawn").fit(module, loader)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    got = bn_buffers(module)  # rank 0's module, brought back to this process by the spawn strategy
    for rank in ranks:
        assert_equal_buffers({k: v for k, v in rank["state"].items() if "running" in k}, got, rel=0)
    steps = [torch.cat([a, b]) for a, b in zip(ranks[0]["batches"], ranks[1]["batches"], strict=True)]
    again = copy.deepcopy(module)
    bnrecal.recalibrate(again, steps, progress=False)  # one process over the ranks' step batches put together
    assert_equal_buffers(got, bn_buffers(again))
    written = json.loads(next(tmp_path.rglob("bnrecal-report.json")).read_text())
    assert (written["world_size"], written["backend"], written["samples"]) == (2, "torch.distributed:gloo", SAMPLES)


def test_with_evaluation_data_the_new_statistics_are_kept_only_where_top1_does_not_drop(tmp_path):
    module = Classifier()
    loader = DataLoader(dataset(), batch_size=BATCH)
    trainer(tmp_path / "fit", [], devices=1).fit(module, loader)
    fitted = bn_buffers(module)
    held_out = DataLoader(dataset(seed=1), batch_size=BATCH)
    shifted = DataLoader(dataset(shift=4.0, seed=2), batch_size=BATCH)  # another camera: its statistics hurt here

    worse = BNRecalibration(data=shifted, eval_data=held_out)
    report = worse.recalibrate(trainer(tmp_path / "worse", [], devices=1), module)
    assert report.gate.after < report.gate.before and not report.gate.kept
    assert "put back" in report["gate"]["reason"]
    assert_equal_buffers(bn_buffers(module), fitted, rel=0)

    better = BNRecalibration(data=DataLoader(dataset(shift=4.0, seed=3), batch_size=BATCH),
                             eval_data=DataLoader(dataset(shift=4.0, seed=4), batch_size=BATCH))
    report = better.recalibrate(trainer(tmp_path / "better", [], devices=1), module)
    assert report.gate.kept and report.gate.after >= report.gate.before
    assert report.to_dict()["gate"]["kept"] is True


def test_the_pytorch_lightning_package_gets_its_own_callback(tmp_path):
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    callback = BNRecalibration.for_package("pytorch_lightning")(max_samples=48)
    assert isinstance(callback, pytorch_lightning.Callback)
    assert BNRecalibration.for_package("lightning.pytorch") is BNRecalibration

    class Module(pytorch_lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Classifier()

        def forward(self, x):
            return self.inner(x)

        def training_step(self, batch, _index):
            return self.inner.training_step(batch, _index)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    module = Module()
    pytorch_lightning.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[callback], logger=False,
                              enable_progress_bar=False, enable_checkpointing=False,
                              default_root_dir=tmp_path).fit(module, DataLoader(dataset(), batch_size=BATCH))
    assert callback.report["samples"] == 48


def test_a_bad_option_fails_when_the_callback_is_made_not_after_training():
    with pytest.raises(TypeError, match="unexpected keyword argument 'wrokers'"):
        BNRecalibration(wrokers=2)
    with pytest.raises(bnrecal.SpecError, match="every_n_epochs"):
        BNRecalibration(every_n_epochs=0)

