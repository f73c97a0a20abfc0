"""Evaluation before and after recalibration: did the new statistics help, and by how much.

Each rank runs its shard of the evaluation data through two copies of the model, one
with the uploaded BN statistics ("before") and one with the recalibrated ones ("after"),
and adds up what it saw in one float64 vector; the ranks combine the vectors with a
single allreduce, so every rank ends with the job's totals. Pure torch, no Ray: tests
and references run it with a ``SingleProcessCollective``.

What is measured depends on what the model returns and whether the data has labels:

- always: the share of predictions (argmax over the class axis) that the new
  statistics change, and the mean KL divergence KL(before || after) of the softmax
  outputs. An output of shape (N, C, ...) is compared per position (segmentation).
- with labels and (N, classes) logits: top-1, top-5 (10 classes or more) and the mean
  cross-entropy of each model.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bnrecal.workers.engine.batchnorm import layers_named
from bnrecal.workers.engine.statistics_pass import apply_statistics
from bnrecal.workers.engine.collective import Collective
from bnrecal.errors import EvaluationError, first_line

TOP5_MIN_CLASSES = 10
"""Top-5 accuracy is reported for models with at least this many classes."""

_TOTALS = (
    "samples", "positions", "changed", "kl", "labelled",
    "top1_before", "top5_before", "ce_before", "top1_after", "top5_after", "ce_after",
)
_INDEX = {name: i for i, name in enumerate(_TOTALS)}

StepCallback = Callable[[int], None]


@dataclass(frozen=True)
class ModelScores:
    """One model's accuracy on the labelled evaluation data: top-1, cross-entropy (mean,
    natural log) and, for models of ``TOP5_MIN_CLASSES`` classes or more, top-5."""

    top1: float
    cross_entropy: float
    top5: float | None = None


@dataclass(frozen=True)
class EvalMetrics:
    """The evaluation before and after, combined over the ranks (docs/evaluation.md, "What is
    measured"): the report's ``evaluation`` section without its data and runtime; ``seconds``
    is the pass of the rank that measured it, where timed."""

    samples: int
    classes: int
    output_shape: list[int]
    labelled: bool
    prediction_change: float
    kl_divergence: float
    before: ModelScores | None = None
    after: ModelScores | None = None
    note: str | None = None
    seconds: float | None = None
"""Called after each evaluation batch with the number of samples this rank evaluated in it."""


@dataclass(frozen=True)
class EvalTarget:
    """What the driver learned about the model's output on one evaluation sample."""

    classes: int
    output_shape: tuple[int, ...]  # one sample's output, e.g. (10,) or (21, 64, 64)
    labelled: bool  # labels are given and the output is (N, classes): accuracy is measured
    note: str | None = None  # why labels were not used, when they were given


def model_logits(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, the ``out`` entry of a mapping
    (torchvision's segmentation models), the ``logits`` entry of one (Hugging Face's
    ``ModelOutput``, an ``OrderedDict``), or the first element of a tuple (auxiliary heads).

    Raises :class:`EvaluationError` for anything else, naming what the model returned.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        for key in ("out", "logits"):
            value = output.get(key)
            if isinstance(value, torch.Tensor):
                return value
        raise EvaluationError(
            f"evaluation needs a tensor of logits; the model returns a mapping with keys {sorted(map(str, output))} "
            "and no tensor 'out' or 'logits'"
        )
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise EvaluationError(f"evaluation needs a tensor of logits; the model returns {type(output).__name__}")


def check_eval_output(model: nn.Module, sample: torch.Tensor, labels: np.ndarray | None) -> EvalTarget:
    """Run ``model`` (in eval mode) on one evaluation sample and decide what can be measured.

    Fails with a clear :class:`EvaluationError` before any actor starts when the model
    cannot run on the data, returns no class axis, or has fewer outputs than the labels need.
    """
    model.eval()
    try:
        with torch.inference_mode():
            logits = model_logits(model(sample.to(torch.float32)))
    except EvaluationError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own error, reported in one line
        raise EvaluationError(
            f"the model cannot run on the evaluation data (sample shape {tuple(sample.shape[1:])}): "
            f"{type(exc).__name__}: {first_line(exc)}"
        ) from None
    if logits.dim() < 2 or logits.shape[1] < 2:
        raise EvaluationError(
            f"evaluation needs outputs with a class axis of 2 or more (N, classes, ...); "
            f"the model outputs shape {tuple(logits.shape)}"
        )
    classes = int(logits.shape[1])
    shape = tuple(int(d) for d in logits.shape[1:])
    if labels is None:
        return EvalTarget(classes, shape, labelled=False)
    if logits.dim() != 2:
        note = (
            f"labels not used: accuracy needs (N, classes) logits and the model outputs (N, {', '.join(map(str, shape))}); "
            "prediction change and KL divergence are measured per position"
        )
        return EvalTarget(classes, shape, labelled=False, note=note)
    if labels.size and int(labels.max()) >= classes:
        raise EvaluationError(
            f"evaluation labels go up to {int(labels.max())} but the model outputs {classes} classes "
            "(labels must be class indices 0..classes-1)"
        )
    return EvalTarget(classes, shape, labelled=True)


class EvalTotals:
    """The running sums one rank adds up, in float64, combined across ranks at the end."""

    def __init__(self) -> None:
        self.values = torch.zeros(len(_TOTALS), dtype=torch.float64)

    def add(self, before: torch.Tensor, after: torch.Tensor, labels: torch.Tensor | None) -> None:
        """Add one batch of both models' logits (and its labels, when accuracy is measured)."""
        v, i = self.values, _INDEX
        v[i["samples"]] += before.shape[0]
        log_before = _positions(before)
        log_after = _positions(after)
        v[i["positions"]] += log_before.shape[0]
        v[i["changed"]] += (log_before.argmax(1) != log_after.argmax(1)).sum().item()
        v[i["kl"]] += F.kl_div(log_after, log_before, reduction="sum", log_target=True).item()
        if labels is None:
            return
        y = labels.to(before.device, torch.int64)
        v[i["labelled"]] += y.shape[0]
        for name, logits in (("before", log_before), ("after", log_after)):
            v[i[f"top1_{name}"]] += (logits.argmax(1) == y).sum().item()
            if logits.shape[1] >= TOP5_MIN_CLASSES:
                top5 = logits.topk(5, dim=1).indices
                v[i[f"top5_{name}"]] += (top5 == y[:, None]).any(1).sum().item()
            v[i[f"ce_{name}"]] += F.nll_loss(logits, y, reduction="sum").item()

    def summary(self, target: EvalTarget) -> EvalMetrics:
        """The report's metrics from the (combined) totals."""
        v = {name: float(self.values[i]) for name, i in _INDEX.items()}
        positions = max(v["positions"], 1.0)
        scores: dict[str, ModelScores] = {}
        if target.labelled and v["labelled"] > 0:
            for name in ("before", "after"):
                scores[name] = ModelScores(
                    top1=v[f"top1_{name}"] / v["labelled"],
                    cross_entropy=v[f"ce_{name}"] / v["labelled"],
                    top5=v[f"top5_{name}"] / v["labelled"] if target.classes >= TOP5_MIN_CLASSES else None,
                )
        return EvalMetrics(
            samples=int(v["samples"]), classes=target.classes, output_shape=list(target.output_shape),
            labelled=target.labelled, prediction_change=v["changed"] / positions, kl_divergence=v["kl"] / positions,
            before=scores.get("before"), after=scores.get("after"), note=target.note or None,
        )


def _positions(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities in float64, one row per prediction: (N, C) as is, (N, C, ...) per position."""
    if logits.dim() > 2:
        logits = logits.movedim(1, -1).reshape(-1, logits.shape[1])
    return F.log_softmax(logits.to(torch.float64), dim=1)


def evaluation_pass(
    before: nn.Module,
    after: nn.Module,
    batches: Iterable[torch.Tensor],
    labels: Sequence[np.ndarray | None],
    target: EvalTarget,
    *,
    collective: Collective,
    device: torch.device | str = "cpu",
    channels_last: bool = False,
    on_step: StepCallback | None = None,
) -> tuple[EvalMetrics, float]:
    """Evaluate this rank's batches with both models, then combine every rank's totals.

    ``labels`` holds each batch's labels (None without labels). Every rank makes exactly
    one allreduce, also one whose shard is empty. Returns the job's metrics and this
    rank's seconds.
    """
    started = time.perf_counter()
    totals = EvalTotals()
    layout = torch.channels_last
    for model in (before, after):
        model.eval()
        if channels_last:
            model.to(memory_format=layout)
    with torch.inference_mode():
        for batch, batch_labels in zip(batches, labels, strict=True):
            if batch.shape[0] == 0:
                continue
            x = batch.to(device, dtype=torch.float32, non_blocking=True)
            if channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=layout)
            y = torch.from_numpy(batch_labels) if target.labelled and batch_labels is not None else None
            totals.add(model_logits(before(x)), model_logits(after(x)), y)
            if on_step is not None:
                on_step(int(batch.shape[0]))
    combined = totals.values.to(device)
    collective.allreduce(combined)
    totals.values = combined.cpu()
    return totals.summary(target), time.perf_counter() - started


def with_statistics(model: nn.Module, layer_names: Sequence[str], stats: Sequence[Any], steps: int) -> nn.Module:
    """A copy of ``model`` whose named BN layers carry ``stats`` (the recalibrated model)."""
    after = copy.deepcopy(model)
    apply_statistics(layers_named(after, layer_names), stats, steps)
    return after
