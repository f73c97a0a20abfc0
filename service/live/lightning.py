"""``bnrecal.lightning.BNRecalibration``: a Lightning callback that recalibrates the module's
BatchNorm statistics inside the Trainer (docs/training.md, "Lightning").

At the end of fit (after ``StochasticWeightAveraging`` has put its average in place, in place
of its train-mode BN epoch), or every N epochs, or before each validation: the module is
recalibrated by ``bnrecal.recalibrate`` on the Trainer's own ranks (under ``ddp`` and
``ddp_spawn`` on its process group, each rank on its shard of the train dataloader; on one
device in the process). With evaluation data it gates: the new statistics are kept only if
top-1 does not drop, else the old ones are put back, and the report says which and why. The
report's figures go to the Trainer's logger and ``bnrecal-report.json`` beside its logs.

Lightning ships as ``lightning`` (``lightning.pytorch``) and as ``pytorch_lightning``; the
callback subclasses the installed one's ``Callback`` (``lightning.pytorch`` where both are),
and ``BNRecalibration.for_package("pytorch_lightning")`` is the one for the other. This
module is imported only by ``bnrecal.lightning``: ``import bnrecal`` never loads Lightning.
"""

from __future__ import annotations

import importlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bnrecal.errors import SpecError
from bnrecal.workers.data.formats.loader import model_input

from bnrecal.service.report_part import ReportPart
from bnrecal.service.run.options import RecalibrationOptions
from bnrecal.service.tracking import report_figures  # the figures by the names MLflow runs use too

from .many import statistics_buffers
from .report import RecalibrationReport
from .run import Forward, live_options, recalibrate

REPORT_NAME = "bnrecal-report.json"
PACKAGES = ("lightning.pytorch", "pytorch_lightning")


class GateSection(ReportPart):
    """The report's ``gate`` (docs/report.md): top-1 on the evaluation data before and after,
    and whether the new statistics were kept (they are where top-1 did not drop)."""

    metric: str = "top1"
    before: float
    after: float
    kept: bool
    reason: str


class _Recalibration:
    """What the callback does, whichever Lightning package's ``Callback`` it is."""

    def __init__(
        self,
        data: Any = None,
        options: RecalibrationOptions | None = None,
        *,
        every_n_epochs: int | None = None,
        before_validation: bool = False,
        eval_data: Any = None,
        forward: Forward | None = None,
        **overrides: Any,
    ) -> None:
        """``data``: a DataLoader, Dataset or path (default: the Trainer's train dataloader,
        each rank's shard of it under DDP); ``options`` and ``overrides`` as
        ``bnrecal.recalibrate`` takes them; when: at the end of fit (default), every
        ``every_n_epochs`` epochs, or before each validation; ``eval_data``: labelled batches
        ``(input, label)`` that gate the new statistics on top-1."""
        super().__init__()
        if every_n_epochs is not None and (isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int)
                                           or every_n_epochs < 1):
            raise SpecError(f"every_n_epochs must be an integer >= 1, got {every_n_epochs!r}", field="every_n_epochs")
        self.options = live_options(options, overrides, "BNRecalibration")  # a bad option fails here, not after training
        self.data, self.eval_data, self.forward = data, eval_data, forward
        self.every_n_epochs, self.before_validation = every_n_epochs, before_validation
        self.reports: list[RecalibrationReport] = []

    @property
    def report(self) -> RecalibrationReport | None:
        """The last recalibration's report (None before the first)."""
        return self.reports[-1] if self.reports else None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.every_n_epochs is None and not self.before_validation:
            self.recalibrate(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.recalibrate(trainer, pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.before_validation and not trainer.sanity_checking:
            self.recalibrate(trainer, pl_module)

    def recalibrate(self, trainer: Any, pl_module: nn.Module) -> RecalibrationReport:
        """Recalibrate ``pl_module`` now, on the Trainer's ranks, gated on ``eval_data``."""
        group = _group(trainer)
        data = self.data if self.data is not None else _train_loader(trainer)
        asked = self.options
        if "device" not in asked.model_fields_set and next(pl_module.parameters()).is_cuda:
            asked = asked.model_copy(update={"device": "cuda"})
        kept = {key: value.detach().clone() for key, value in statistics_buffers(pl_module).items()}
        before = _top1(pl_module, self.eval_data, group, self.forward) if self.eval_data is not None else None
        report = recalibrate(pl_module, data, asked, forward=self.forward, progress=False, process_group=group)
        if before is not None:
            after = _top1(pl_module, self.eval_data, group, self.forward)
            keep = after >= before
            if not keep:
                with torch.no_grad():
                    for key, value in statistics_buffers(pl_module).items():
                        value.copy_(kept[key])
            reason = (f"top-1 {after:.4f} after against {before:.4f} before: "
                      + ("kept the new statistics" if keep else "it dropped, so the old statistics were put back"))
            report.gate = GateSection(before=before, after=after, kept=keep, reason=reason)
        self.reports.append(report)
        _log(trainer, report)
        return report


@cache
def callback_class(package: str) -> type:
    """The callback as a subclass of ``package``'s ``Callback`` (``lightning.pytorch`` or
    ``pytorch_lightning``)."""
    if package not in PACKAGES:
        raise ValueError(f"package must be one of {', '.join(PACKAGES)}, not {package!r}")
    try:
        base = importlib.import_module(package).Callback
    except ImportError:
        raise ImportError(f"bnrecal.lightning needs {package}: pip install 'bnrecal[lightning]'") from None
    cls = type("BNRecalibration", (_Recalibration, base), {"__module__": "bnrecal.lightning",
                                                           "__doc__": _Recalibration.__doc__})
    cls.for_package = staticmethod(callback_class)  # type: ignore[attr-defined]
    return cls


def installed_package() -> str:
    """The Lightning package the default callback is for: ``lightning.pytorch``, else ``pytorch_lightning``."""
    for package in PACKAGES:
        try:
            importlib.import_module(package)
            return package
        except ImportError:
            continue
    raise ImportError("bnrecal.lightning needs Lightning: pip install 'bnrecal[lightning]'")


def _group(trainer: Any) -> Any:
    """The Trainer's process group where it runs several ranks, else None (one process)."""
    import torch.distributed as dist

    if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _train_loader(trainer: Any) -> Any:
    """The Trainer's train dataloader (each rank's shard under DDP), which must be one loader."""
    loader = trainer.train_dataloader
    if loader is None:
        trainer.fit_loop.setup_data()
        loader = trainer.train_dataloader
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise SpecError("the Trainer's train dataloader is not one DataLoader: give BNRecalibration(data=...)",
                        field="data")
    return loader


@torch.no_grad()
def _top1(module: nn.Module, data: Any, group: Any, forward: Forward | None) -> float:
    """Top-1 of ``module`` (eval mode, its own statistics) on labelled batches ``(input, label)``,
    over every rank's batches where there is a group."""
    training = module.training
    module.eval()
    device = next(module.parameters()).device
    right = total = 0
    try:
        for batch in data:
            if not isinstance(batch, (tuple, list)) or len(batch) < 2:
                raise SpecError("eval_data must yield (input, label) batches", field="eval_data")
            output = forward(module, batch) if forward is not None else module(model_input(batch).to(device))
            labels = batch[1].to(device)
            right += int((output.argmax(dim=1) == labels).sum())
            total += len(labels)
    finally:
        module.train(training)
    counts = torch.tensor([right, total], dtype=torch.float64)
    if group is not None:
        import torch.distributed as dist

        if dist.get_backend(group) == "nccl":  # NCCL combines CUDA tensors only
            counts = counts.to(device)
        dist.all_reduce(counts, group=group)
        counts = counts.cpu()
    if counts[1] == 0:
        raise SpecError("eval_data holds no samples", field="eval_data")
    return float(counts[0] / counts[1])


def _log(trainer: Any, report: RecalibrationReport) -> None:
    """The report's figures to the Trainer's logger, and the report beside its logs (rank 0)."""
    metrics = {f"bnrecal/{name}": value for name, value in report_figures(report).items()}
    folder = Path(trainer.log_dir or trainer.default_root_dir)  # every rank asks: under DDP it is a broadcast
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / REPORT_NAME).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
