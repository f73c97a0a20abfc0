"""One rank's calibration pass: the loop over its shard, pure torch, no Ray.

The actor runs this with a ``RayCollective``; tests and references run it with a
``SingleProcessCollective``. Progress goes out through a callback after each step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bnrecal.workers.data.formats.loader import Step, move_to
from bnrecal.workers.engine.batchnorm import BatchNormLayer
from bnrecal.workers.engine.calibrator import BatchNormCalibrator
from bnrecal.workers.engine.collective import Collective
from bnrecal.workers.engine.memory_format import rank_layout, to_layout, torch_format
from bnrecal.workers.engine.moments import MomentStats
from bnrecal.errors import DatasetError

Feed = Callable[[nn.Module, Any], Any]
"""``forward(model, batch)``: how a user's batches reach the model (``bnrecal.recalibrate``)."""

StepCallback = Callable[[int, int], None]
"""Called after each step with (step index, samples this rank processed in it)."""


MIN_STEPS = 16
"""Steps a pass with a :class:`StopRule` runs at least: the standard errors come from the
spread between steps, and from fewer than about 16 of them that spread is itself too
uncertain (+-18% at 16) to stop on."""


@dataclass(frozen=True)
class StopRule:
    """``max_samples: "auto"``: stop after the first step (from ``min_steps`` on) at which every
    layer's standard errors, mean (std units) and variance (relative), worst channel, are at
    most ``tolerance``. Only in ``sync`` mode, where every rank sees the same global numbers
    and so stops at the same step."""

    tolerance: float
    min_steps: int = MIN_STEPS


@dataclass
class Convergence:
    """Where a pass with a :class:`StopRule` ended: whether it converged (else the data ran
    out first), and the worst standard error then, its layer index and statistic."""

    converged: bool
    error: float | None
    layer: int | None
    statistic: str | None
    min_steps: int = MIN_STEPS


@dataclass
class PassResult:
    """What one rank's pass produced: every layer's combined statistics and counters."""

    stats: list[MomentStats]
    calls: list[int]
    steps: int
    samples: int
    collectives: int
    seconds: float
    memory_format: str = "contiguous"
    convergence: Convergence | None = None


@contextmanager
def full_float32(device: torch.device | str) -> Iterator[None]:
    """On CUDA, convolutions and matrix products in full float32 while the pass runs.

    torch lets cuDNN run float32 convolutions in TF32 (a 10-bit mantissa) by default, and on
    an H200 that moved resnet50's BN variances by up to 0.4% against a float64 reference
    (bench/gpu_check.sh; the CPU computes in float32 and lands within 3e-5): the statistics
    of a float32 model would depend on the device (docs/calibration.md, "Numerics"). The
    caller's settings are put back after the pass."""
    if torch.device(device).type != "cuda":
        yield
        return
    if hasattr(torch.backends.cudnn, "conv"):  # torch >= 2.9: the precision API (mixing it with the flags fails)
        flags = [(torch.backends.cudnn.conv, "fp32_precision"), (torch.backends.cuda.matmul, "fp32_precision")]
        exact: object = "ieee"
    else:
        flags = [(torch.backends.cudnn, "allow_tf32"), (torch.backends.cuda.matmul, "allow_tf32")]
        exact = False
    saved = [getattr(owner, name) for owner, name in flags]
    for owner, name in flags:
        setattr(owner, name, exact)
    try:
        yield
    finally:
        for (owner, name), value in zip(flags, saved):
            setattr(owner, name, value)


def calibration_pass(
    model: nn.Module,
    layers: Sequence[BatchNormLayer],
    batches: Iterable[torch.Tensor | Step],
    *,
    mode: str,
    collective: Collective,
    call_order: Sequence[int] = (),
    device: torch.device | str = "cpu",
    on_step: StepCallback | None = None,
    memory_format: str = "auto",
    sample_ranges: Sequence[tuple[int, int]] | None = None,
    step_ranges: Sequence[tuple[int, int]] | None = None,
    feed: Feed | None = None,
    stop: StopRule | None = None,
    row_of: Callable[[int], int] | None = None,
    shifts: Sequence[torch.Tensor] | None = None,
) -> PassResult:
    """Run ``model`` over this rank's batches with its BN layers calibrating.

    ``batches`` yields one tensor per global step (empty where this rank's slice is
    empty), or one :class:`~workers.data.formats.loader.Step` (a batch in the user's structure,
    fed to the model by ``feed(model, batch)`` when given). Every module other than BN
    runs in eval mode. Returns the statistics of every layer over everything every rank
    saw; in ``local`` mode that includes the job's single allreduce. ``memory_format`` (``auto``, ``contiguous``,
    ``channels_last``) is the layout the rank computes in (``auto``: channels-last for
    image batches, see ``workers.engine.memory_format``).

    A step in which a NaN or inf reaches a BN layer fails the pass at its end with a
    ``DatasetError`` naming the first layer and the samples: ``sample_ranges`` are this
    rank's ``[start, stop)`` per step and ``step_ranges`` the whole global batch's, as
    global sample indices (default: counted from this rank's batches, right for a world of one).

    ``row_of`` maps a sample position to its row in the user's file (a shuffled order), so an
    error names the row the user can find. ``shifts`` are what each layer's moments are summed
    about where the ranks' models may hold different buffers (a caller's own training ranks):
    the same on every rank (default: the layers' ``running_mean``). With a ``stop`` rule (``sync`` mode only) the pass ends at the first step where every
    layer's standard errors are within its tolerance; ``convergence`` says where it ended.
    """
    if stop is not None and mode != "sync":
        raise ValueError("a stop rule needs sync mode: local ranks see no global statistics during the pass")
    model.eval()
    convergence = None
    started = time.perf_counter()
    steps = samples = 0
    layout: str | None = None
    dims = 0
    calibrator = BatchNormCalibrator(layers, mode, collective, call_order, shifts=shifts)
    with full_float32(device), torch.inference_mode(), calibrator:
        for item in batches:
            batch, size = _unpack(item)
            if size == 0:
                calibrator.replay_empty_step()
            elif feed is not None:
                feed(model, move_to(batch, device))
            else:
                if layout is None:
                    dims = batch.dim()
                    layout = rank_layout(memory_format, dims)
                    to_layout(model, layout, dims)
                x = batch.to(device, dtype=torch.float32, non_blocking=True)
                model(x.contiguous(memory_format=torch_format(layout, dims)))
            where = calibrator.first_non_finite()
            if where is not None:
                own = sample_ranges[steps] if sample_ranges is not None else (samples, samples + size)
                step = step_ranges[steps] if step_ranges is not None else own
                shown = batch if isinstance(batch, torch.Tensor) else torch.empty(0)
                raise non_finite_error(where, steps, shown, own, own if mode == "local" else step, row_of)
            calibrator.end_step()
            steps += 1
            samples += size
            if on_step is not None:
                on_step(steps - 1, size)
            if stop is not None and steps >= stop.min_steps:
                convergence = _converged(calibrator, stop)
                if convergence.converged:
                    break
        if stop is not None and (convergence is None or not convergence.converged):
            convergence = _converged(calibrator, stop)  # the data ran out first
            convergence.converged = convergence.converged and steps >= stop.min_steps
        stats = calibrator.moments()
    if layout == "channels_last":
        to_layout(model, "contiguous", dims)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return PassResult(
        stats=stats,
        calls=list(calibrator.calls),
        steps=steps,
        samples=samples,
        collectives=collective.calls,
        seconds=time.perf_counter() - started,
        memory_format=layout or "contiguous",
        convergence=convergence,
    )


def _converged(calibrator: BatchNormCalibrator, stop: StopRule) -> Convergence:
    """Whether every layer's standard errors are within the rule's tolerance now."""
    worst = calibrator.worst_error()
    if worst is None:
        return Convergence(False, None, None, None, stop.min_steps)
    error, layer, statistic = worst
    return Convergence(error <= stop.tolerance, error, layer, statistic, stop.min_steps)


def _unpack(item: torch.Tensor | Step) -> tuple[Any, int]:
    """A step's batch and its number of samples."""
    if isinstance(item, Step):
        return item.value, item.size
    return item, int(item.shape[0])


def non_finite_error(
    where: str,
    step: int,
    batch: torch.Tensor,
    own: tuple[int, int],
    seen: tuple[int, int],
    row_of: Callable[[int], int] | None = None,
) -> DatasetError:
    """The error of a step whose statistics went non-finite at ``where``: the first sample of
    this rank's ``batch`` (global indices from ``own``) with a NaN or inf when there is one,
    else the samples ``seen`` (the global batch in sync mode, where another rank's slice may
    hold it; a finite batch can also overflow, or meet non-finite weights). With ``row_of`` (a
    shuffled order) the sample is named by its row in the file and the ranges as positions of the order."""
    kind = "samples" if row_of is None else "positions of the shuffled order"
    if batch.numel():
        bad = (~torch.isfinite(batch.reshape(batch.shape[0], -1))).any(dim=1).nonzero()
        if bad.numel():
            sample = own[0] + int(bad[0])
            row = sample if row_of is None else row_of(sample)
            return DatasetError(
                f"calibration sample {row} has non-finite values (NaN or inf), first seen by {where} "
                f"in step {step} ({kind} {own[0]}-{own[1] - 1}): fix or leave out that sample"
            )
    return DatasetError(
        f"non-finite values (NaN or inf) first reached {where} in step {step} ({kind} {seen[0]}-{seen[1] - 1}): "
        "check those samples of the calibration data (values too large for float32?) and the checkpoint's weights"
    )


def apply_statistics(layers: Sequence[BatchNormLayer], stats: Sequence[MomentStats], steps: int) -> list[str]:
    """Write the recalibrated statistics into the layers' own buffers.

    ``running_mean`` becomes the mean and ``running_var`` the unbiased variance of
    every value seen, cast to each buffer's dtype; ``num_batches_tracked`` grows by
    ``steps``. Layers the pass never reached keep their statistics; their names are
    returned.
    """
    unreached: list[str] = []
    for layer, stat in zip(layers, stats):
        if stat.count <= 0:
            unreached.append(layer.name)
            continue
        with torch.no_grad():
            layer.running_mean.copy_(stat.mean.to(layer.running_mean.dtype))
            layer.running_var.copy_(stat.unbiased_var.to(layer.running_var.dtype))
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.add_(steps)
    return unreached
