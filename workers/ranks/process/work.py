"""A rank's work that needs no Ray, and the one-rank run in the calling process.

``rank_batches`` (the batches a rank reads, with their global sample ranges) and
``evaluate_rank`` (its evaluation after calibration) are what a rank actor does
(``workers.ranks.process.actor``); ``run_in_process`` does the same as the only rank of a world of
one, in the calling process, with the engine's calibration pass and a
``SingleProcessCollective``: ``bnrecal.recalibrate(..., workers=1)`` and ``bnrecal
calibrate --workers 1`` run here when no Ray cluster is named. The statistics are those of
every other path (docs/calibration.md, "The statistics"): the same data, the same pass, a
world of one. This module never imports Ray.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from bnrecal.workers.data import CalibrationData, iter_batches
from bnrecal.workers.data.reading.device_decode import on_device
from bnrecal.workers.data.reading.kept import open_kept
from bnrecal.workers.data.formats.loader import LoaderSpec, Step
from bnrecal.workers.engine.batchnorm import BatchNormLayer, layers_named
from bnrecal.workers.engine.statistics_pass import PassResult, calibration_pass
from bnrecal.workers.engine.calibrator import device_of, probe_call_order
from bnrecal.workers.engine.collective import Collective, SingleProcessCollective
from bnrecal.workers.engine.evaluation import EvalMetrics, EvalTarget, check_eval_output, evaluation_pass, with_statistics
from bnrecal.workers.engine.moments import MomentStats
from bnrecal.errors import CancelledError
from bnrecal.workers.ranks.plan import GroupResult, ModelChecks, RankPlan
from bnrecal.workers.ranks.sharding import rank_ranges, step_ranges

IN_PROCESS = "in-process"
"""The report's ``backend`` (and node) of a one-worker run without Ray."""

Ranges = list[tuple[int, int]]


def rank_batches(
    plan: RankPlan, rank: int, shard: CalibrationData | None = None
) -> tuple[Iterator[Any], Ranges, Ranges]:
    """Rank ``rank``'s batches of every global step (empty ones included), with its
    ``[start, stop)`` per step and every step's global range, as global sample indices.

    ``shard`` is the rank's data when it came through the object store; without it the
    rank opens the dataset itself (a path, a prefix, or Python objects).
    """
    if isinstance(plan.dataset, LoaderSpec):
        ranges = plan.dataset.rank_ranges(rank, plan.world_size)
        return plan.dataset.rank_steps(rank, plan.world_size), ranges, plan.dataset.step_ranges()
    data = open_kept(plan.dataset, on_device(shard if shard is not None else plan.dataset.open(), plan.device))
    loader_workers = plan.loader_workers if shard is None else 0
    ranges = rank_ranges(plan.dataset.num_samples, plan.batch_size, plan.world_size, rank)
    steps = step_ranges(plan.dataset.num_samples, plan.batch_size)
    return iter_batches(data, ranges, num_workers=loader_workers), ranges, steps


def keeping_head(
    batches: Iterable[Any], ranges: Ranges, count: int, head: list[tuple[int, torch.Tensor]]
) -> Iterator[Any]:
    """``batches`` as they are, with a copy of the samples at positions below ``count`` put
    in ``head`` as ``(position, samples)`` on the way: the first samples of the order, as
    the ranks read them, for the checks of an export (so the driver never reads them)."""
    for (start, stop), batch in zip(ranges, batches):
        if start < min(stop, count) and isinstance(batch, torch.Tensor):
            head.append((start, batch[: min(stop, count) - start].detach().cpu().clone()))
        yield batch


def joined_head(parts: Iterable[tuple[int, torch.Tensor]]) -> torch.Tensor | None:
    """The head pieces of every rank, in position order, as one batch (None without any)."""
    ordered = [samples for _, samples in sorted(parts, key=lambda part: part[0])]
    return torch.cat(ordered) if ordered else None


def check_model(
    model: torch.nn.Module, layers: list[BatchNormLayer], checks: ModelChecks, feed: Callable[[Any, Any], Any] | None,
) -> tuple[tuple[int, ...], EvalTarget | None]:
    """The checks a run makes on its model before its pass, wherever they run (the job's host
    before any rank starts, or every rank of a sweep's cell): the BN call order on the probe,
    which catches data the model rejects and layers that cannot be calibrated, and with an
    evaluation sample what the evaluation can measure (``check_eval_output``)."""
    call_order = tuple(probe_call_order(model, layers, checks.probe, feed))
    target = None
    if checks.eval_probe is not None:
        target = check_eval_output(model, checks.eval_probe.to(device_of(model)), checks.labels)
    return call_order, target


def checked_plan(
    plan: RankPlan, model: torch.nn.Module, layers: list[BatchNormLayer]
) -> tuple[RankPlan, EvalTarget | None]:
    """The plan as this rank runs it, with what its ``checks`` find on the rank's ``model``
    (where a job's host left them to the ranks, ``ModelChecks``): the BN call order, and
    the evaluation's target, which comes back too (the later phases measure by it). Without
    checks, as it is."""
    if plan.checks is None:
        return plan, None
    call_order, target = check_model(model, layers, plan.checks, plan.feed)
    evaluation = plan.evaluation
    if evaluation is not None and evaluation.target is None:
        evaluation = replace(evaluation, target=target)
    return replace(plan, call_order=call_order, evaluation=evaluation, checks=None), target


def evaluate_rank(
    plan: RankPlan,
    rank: int,
    model: torch.nn.Module,
    calibration: PassResult,
    shard: CalibrationData | None,
    collective: Collective,
    on_samples: Callable[[int], None] | None = None,
) -> EvalMetrics:
    """Evaluate rank ``rank``'s evaluation shard before and after; every rank gets the job's metrics."""
    evaluation = plan.evaluation
    assert evaluation is not None
    after = with_statistics(model, plan.layer_names, calibration.stats, calibration.steps)
    data = open_kept(evaluation.dataset, on_device(shard if shard is not None else evaluation.dataset.open(), plan.device))
    ranges = rank_ranges(evaluation.dataset.num_samples, evaluation.batch_size, plan.world_size, rank)
    labels = [evaluation.labels[start:stop] if evaluation.labels is not None else None for start, stop in ranges]
    loader_workers = plan.loader_workers if shard is None else 0
    metrics, seconds = evaluation_pass(
        model,
        after,
        iter_batches(data, ranges, num_workers=loader_workers),
        labels,
        evaluation.target,
        collective=collective,
        device=torch.device(plan.device),
        channels_last=calibration.memory_format == "channels_last",
        on_step=on_samples,
    )
    return replace(metrics, seconds=seconds)


def run_in_process(
    plan: RankPlan,
    model: torch.nn.Module,
    *,
    on_progress: Callable[[str, int], None] | None = None,
    cancel: threading.Event | None = None,
    collective: Collective | None = None,
    rank: int = 0,
) -> GroupResult:
    """Run a job's rank on ``model`` in this process, as a rank actor would: a world of one,
    or, with ``collective`` (a caller's ``torch.distributed`` group), rank ``rank`` of that
    group's world, every other rank running the same call in its own process.

    With a group, a plan of the group's world size is split as the Ray ranks split theirs
    (rank ``rank`` reads its part of every global step); a plan of one is this rank's own
    data (its DataLoader over its shard), whose steps the ranks agree on step by step, a
    rank whose data ran out taking part in every collective with an empty step. The counts
    that come back are the group's.

    ``model`` is run as it is (the caller gives a model of its own: a copy or a view of a
    user's module, a checkpoint's model). ``on_progress`` gets the phase and the samples
    done so far, like ``run_rank_group``'s; ``cancel`` stops it between steps.
    """
    collective = collective if collective is not None else SingleProcessCollective()
    if plan.world_size not in (1, collective.world_size):
        raise ValueError(f"a run in the calling process has a world of 1 or the group's, not {plan.world_size}")
    own_data = collective.world_size > 1 and plan.world_size == 1
    rank = 0 if own_data else rank  # the rank's place in the plan's world: its own data is a world of one
    device = torch.device(plan.device)
    model.to(device).eval()
    layers = layers_named(model, plan.layer_names)
    plan, eval_target = checked_plan(plan, model, layers)
    batches, ranges, steps = rank_batches(plan, rank)
    head: list[tuple[int, torch.Tensor]] = []
    batches = keeping_head(batches, ranges, plan.head, head)
    if own_data:
        batches = agreed_steps(batches, collective)
    done = {"calibrating": 0, "evaluating": 0}

    def report(phase: str, samples: int) -> None:
        if cancel is not None and cancel.is_set():
            raise CancelledError("the job was cancelled")
        done[phase] += samples
        if on_progress is not None:
            on_progress(phase, done[phase])

    result = calibration_pass(
        model, layers, batches, mode=plan.mode, collective=collective, call_order=plan.call_order, device=device,
        on_step=lambda step, samples: report("calibrating", samples), memory_format=plan.memory_format,
        sample_ranges=None if own_data else ranges, step_ranges=None if own_data else steps, feed=plan.feed,
        stop=plan.stop, row_of=None if own_data else row_of(plan), shifts=agreed_shifts(layers, collective),
    )
    evaluation = None
    if plan.evaluation is not None:
        evaluation = evaluate_rank(plan, rank, model, result, None, collective, lambda n: report("evaluating", n))
    return GroupResult(
        stats=stats_payload(result),
        steps=result.steps,
        samples=group_samples(result.samples, collective),
        collectives=[result.collectives],
        seconds=result.seconds,
        nodes=[f"{IN_PROCESS}:{os.uname().nodename}"],
        calls=list(result.calls),
        memory_formats=[result.memory_format],
        evaluation=evaluation,
        convergence=result.convergence,
        head=joined_head(head),
        eval_target=eval_target,
    )


def agreed_steps(batches: Iterable[Any], collective: Collective) -> Iterator[Any]:
    """This rank's own batches, one step at a time while any rank of the group has one left:
    an empty step once its own ran out, so that it takes part in every collective of the
    others' steps (one allreduce a step says who has a batch)."""
    mine = iter(batches)
    while True:
        batch = next(mine, None)
        left = torch.tensor([0.0 if batch is None else 1.0], dtype=torch.float64)
        collective.allreduce(left)
        if left.item() == 0:
            return
        yield batch if batch is not None else Step(torch.empty(0), 0)


def agreed_shifts(layers: list[BatchNormLayer], collective: Collective) -> list[torch.Tensor] | None:
    """The shifts every rank of a caller's group sums its moments about: the mean of the ranks'
    ``running_mean`` buffers (training ranks' buffers differ: DDP keeps each rank's own), one
    allreduce; None in a world of one, where the layer's own buffer is the shift."""
    if collective.world_size == 1 or not layers:
        return None
    means = [layer.running_mean.detach().double() for layer in layers]
    joined = torch.cat(means)
    collective.allreduce(joined)
    joined /= collective.world_size
    return list(torch.split(joined, [mean.numel() for mean in means]))


def group_samples(samples: int, collective: Collective) -> int:
    """The samples every rank of the group calibrated on, together (this rank's, alone)."""
    if collective.world_size == 1:
        return samples
    total = torch.tensor([float(samples)], dtype=torch.float64)
    collective.allreduce(total)
    return int(total.item())


def stats_payload(result: PassResult) -> list[MomentStats]:
    """A pass's statistics as rank 0 sends them to the driver (on the CPU), with each layer's
    standard errors per channel where they were estimated."""
    payload = []
    for stat in result.stats:
        both = stat.se_mean is not None and stat.se_var is not None
        payload.append(MomentStats(
            stat.count, stat.mean.cpu(), stat.var.cpu(),
            stat.se_mean.cpu() if both else None, stat.se_var.cpu() if both else None,  # type: ignore[union-attr]
        ))
    return payload


def row_of(plan: RankPlan) -> Callable[[int], int] | None:
    """Position -> file row, where the data is read in a shuffled order (errors name the row)."""
    if isinstance(plan.dataset, LoaderSpec) or plan.dataset.order == "given":
        return None
    rows = plan.dataset.sample_rows()
    return lambda position: int(rows[position])
