"""BatchNorm layers in calibration mode: each layer's own forward runs, only the
statistics it normalises with are replaced.

While a :class:`BatchNormCalibrator` is active, every batch-norm call is seen by a
``TorchFunctionMode``: ``torch.nn.functional.batch_norm``, ``torch.batch_norm`` and the
``aten`` batch-norm ops a ``torch.export`` program calls (``workers.engine.bn_calls`` lists the
forms). A call that passes one of the calibrated layers' running buffers is that layer
normalising: its input's moments are measured (one statistics pass), in ``sync`` mode
combined across ranks in one allreduce, and the call goes on in eval form with those
statistics (one normalising pass). Everything else the layer's class does around that
call (timm's activation and drop path, a subclass's arithmetic, a second call) still
happens.

Calibrated modules run with their own ``training`` flag set, as in training; their
children (an activation, a drop path) stay in eval mode. ``SyncBatchNorm`` layers keep
``training`` off: their training forward would synchronise over ``torch.distributed``
itself, and in eval form they reach ``F.batch_norm`` with their running buffers all the
same, so the product's collective stays the only one. A module whose forward finishes
without normalising through one of those calls fails the pass, naming it. (A program's
layers are its batch-norm calls, found in its graph: there is no forward to watch.)

A BN layer without running statistics (``track_running_stats=False``) has nothing to
recalibrate, but it normalises with batch statistics even in eval mode: in ``sync`` mode
its calls are answered too, with the global batch's statistics (one more allreduce per
call), so every layer after it sees the same values at any number of ranks. In ``local``
mode such a call runs as it is, on the rank's own slice.

``probe_call_order`` runs the model once this way on a sample before any actor starts:
it catches data the model rejects and layers that cannot be calibrated, and records the
order in which the layers normalise (what a rank with an empty slice replays): a layer's
index, or ``-channels`` for a call without running statistics.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from bnrecal.workers.data.formats.loader import move_to
from bnrecal.workers.engine.batchnorm import MODES, BatchNormLayer, unsupported_layer
from bnrecal.workers.engine.bn_calls import BATCH_NORM_FORMS, BatchNormCall, BatchNormForm
from bnrecal.workers.engine.collective import Collective, SingleProcessCollective
from bnrecal.workers.engine.moments import (
    BatchMoments,
    MomentStats,
    accumulate_errors,
    batch_moments,
    error_size,
    finalize,
    pack,
    packed_size,
    standard_errors,
    worst_standard_error,
)
from bnrecal.errors import BnrecalError, CallOrderError, DatasetError, ModelInputError, RunError, first_line
from bnrecal.workers.suggestions import sample_shape_hint
from bnrecal.workers.tracing import holds_tracing

TAGS = 2
"""Packed slots ahead of a sync allreduce's moments: the layer tag and its square. With
SUM, every rank reduced the same layer exactly when the sums are K*t and K*t^2."""


class BatchNormCalibrator:
    """Context manager that puts a model's BN layers in calibration mode.

    Leaving the context restores the layers as they were (training flags and
    ``num_batches_tracked``). ``moments()`` then gives the combined float64 statistics of
    every value each layer saw, across all ranks.
    """

    def __init__(
        self,
        layers: Sequence[BatchNormLayer],
        mode: str,
        collective: Collective,
        call_order: Sequence[int] = (),
        record_order: bool = False,
        shifts: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.layers = list(layers)
        self.mode = mode
        self.collective = collective
        self.call_order = list(call_order)
        # The moments are summed about a shift per layer, the same on every rank: the buffers the
        # model came with (every rank's are the same, or ``shifts``, the ranks' agreed ones).
        self.shifts = ([layer.running_mean.detach().double() for layer in self.layers] if shifts is None
                       else [shift.double() for shift in shifts])
        self.totals = [
            torch.zeros(packed_size(layer.channels), dtype=torch.float64, device=shift.device)
            for layer, shift in zip(self.layers, self.shifts)
        ]
        self.errors = [
            torch.zeros(error_size(layer.channels), dtype=torch.float64, device=shift.device)
            for layer, shift in zip(self.layers, self.shifts)
        ]
        self._step_totals = [torch.zeros_like(total) for total in self.totals]  # this step's moments per layer
        self.calls = [0] * len(self.layers)
        self.untracked_calls = 0
        self.order: list[int] = []
        self._record_order = record_order
        self._by_buffer = {id(layer.running_mean): i for i, layer in enumerate(self.layers)}
        self._mode = _Interceptor(self)
        self._saved: list[tuple[bool, torch.Tensor | None]] = []
        self._hooks: list[Any] = []
        self._in_forward: list[tuple[int, int]] = []
        self._combined = False
        self._step_sums: list[torch.Tensor] = []  # per call this step: the sum of its packed moments
        self._step_calls: list[int] = []  # per call this step: the layer index, or -channels (untracked)

    def __enter__(self) -> BatchNormCalibrator:
        for i, layer in enumerate(self.layers):
            module = layer.module
            tracked = layer.num_batches_tracked
            self._saved.append((layer.owner.training, None if tracked is None else tracked.detach().clone()))
            if module is None:  # a program's layer: its calls are known from the graph
                continue
            module.training = not isinstance(module, nn.SyncBatchNorm)
            self._hooks.append(module.register_forward_pre_hook(self._entering(i)))
            self._hooks.append(module.register_forward_hook(self._leaving(i)))
        self._mode.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._mode.__exit__(*exc_info)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        with torch.no_grad():
            for layer, (training, tracked) in zip(self.layers, self._saved):
                layer.owner.training = training
                if tracked is not None and layer.num_batches_tracked is not None:
                    layer.num_batches_tracked.copy_(tracked)
        self._saved.clear()

    def _entering(self, index: int) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            self._in_forward.append((index, self.calls[index]))

        return hook

    def _leaving(self, index: int) -> Any:
        def hook(_module: nn.Module, _args: Any, _output: Any) -> None:
            entered, calls_before = self._in_forward.pop()
            if entered == index and self.calls[index] == calls_before:
                raise unsupported_layer(self.layers[index])

        return hook

    def layer_in_progress(self) -> BatchNormLayer | None:
        """The innermost calibrated layer whose forward is running and has not normalised yet."""
        for index, calls_before in reversed(self._in_forward):
            if self.calls[index] == calls_before:
                return self.layers[index]
        return None

    def intercept(
        self, form: BatchNormForm, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """Calibrate a batch-norm call (of any form) made with a calibrated layer's buffers;
        ``None`` for any other call, which then runs as it is."""
        call = form.bind(args, kwargs)
        if call.running_mean is None and call.running_var is None:
            return self._batch_statistics_call(form, call)
        index = self._by_buffer.get(id(call.running_mean))
        if index is None or self.layers[index].running_mean is not call.running_mean:
            return None
        x = call.input
        layer = self.layers[index]
        if x.dim() < 2 or x.shape[1] != layer.channels:
            raise ModelInputError(
                f"BN layer {layer.name!r} expects {layer.channels} channels in dimension 1, "
                f"got input of shape {tuple(x.shape)}"
            )
        own = batch_moments(x)
        stats = self._combine(index, own)
        out = _normalise(x, own, stats, call, layer.running_mean.dtype)
        return form.results(out, stats.mean, stats.var, call)

    def _batch_statistics_call(
        self, form: BatchNormForm, call: BatchNormCall
    ) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """A call without running statistics (``track_running_stats=False``): in ``sync``
        mode it normalises with the global batch's statistics, like every other call; in
        ``local`` mode (or where it would not use batch statistics) it runs as it is."""
        x = call.input
        evaluating = call.training is not None and not call.training  # a form without the argument trains
        if self.mode != "sync" or evaluating or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return None
        channels = int(x.shape[1])
        own = batch_moments(x)
        shift = torch.zeros(channels, dtype=torch.float64, device=x.device)
        buffer = torch.empty(TAGS + packed_size(channels), dtype=torch.float64, device=x.device)
        packed = pack(own, shift, buffer[TAGS:])
        self._reduce_untracked(channels, buffer)
        self._note(-channels, packed)
        if self._record_order:
            self.order.append(-channels)
        stats = finalize(packed, shift)
        return form.results(_normalise(x, own, stats, call, x.dtype), stats.mean, stats.var, call)

    def _reduce_untracked(self, channels: int, buffer: torch.Tensor) -> None:
        """The allreduce of the next call without running statistics, tagged by its place
        among such calls (every rank makes them in the same order)."""
        tag = len(self.layers) + 1 + self.untracked_calls
        self.untracked_calls += 1
        self._reduce_tagged(tag, buffer, f"a BN call without running statistics ({channels} channels)")

    def _combine(self, index: int, own: BatchMoments) -> MomentStats:
        """This call's statistics over the global batch (sync) or the rank's slice (local)."""
        shift = self.shifts[index]
        buffer = torch.empty(TAGS + packed_size(shift.numel()), dtype=torch.float64, device=shift.device)
        packed = pack(own, shift, buffer[TAGS:])
        if self.mode == "sync":
            layer = self.layers[index]
            self._reduce_tagged(index + 1, buffer, f"BN layer {layer.name!r} ({layer.class_name})")
        self.totals[index] += packed
        self._step_totals[index] += packed
        self._note(index, packed)
        self.calls[index] += 1
        if self._record_order:
            self.order.append(index)
        if self.mode == "local":
            return MomentStats(float(own.count), own.mean, own.var)
        return finalize(packed, shift)

    def _reduce_tagged(self, tag: int, buffer: torch.Tensor, what: str) -> None:
        """One allreduce of ``buffer`` whose first slots carry ``tag`` and its square: with
        SUM, every rank reduced the same call exactly when they come back as K*t and K*t^2."""
        buffer[0] = float(tag)
        buffer[1] = float(tag) * float(tag)
        self.collective.allreduce(buffer)
        world = float(self.collective.world_size)
        tag_sum, square_sum = buffer[:TAGS].tolist()
        if tag_sum != world * tag or square_sum != world * float(tag) * float(tag):
            raise CallOrderError(
                f"collective {self.collective.calls}: this rank reduced {what} while another rank "
                "reduced a different layer: the model calls its "
                "BN layers in a different order on different ranks (data-dependent control flow?); "
                "sync mode needs the same order on every rank, --mode local does not"
            )

    def replay_empty_step(self) -> None:
        """Take part in a step with no local samples: the same collectives, zero moments."""
        if self.mode != "sync":
            return
        if not self.call_order:
            raise RunError("an empty slice needs the model's BN call order, which was not recorded")
        for index in self.call_order:
            if index < 0:  # a call without running statistics, over -index channels
                device = self.shifts[0].device if self.shifts else torch.device("cpu")
                untracked = torch.zeros(TAGS + packed_size(-index), dtype=torch.float64, device=device)
                self._reduce_untracked(-index, untracked)
                self._note(index, untracked[TAGS:])
                continue
            shift = self.shifts[index]
            buffer = torch.zeros(TAGS + packed_size(shift.numel()), dtype=torch.float64, device=shift.device)
            layer = self.layers[index]
            self._reduce_tagged(index + 1, buffer, f"BN layer {layer.name!r} ({layer.class_name})")
            self.totals[index] += buffer[TAGS:]
            self._step_totals[index] += buffer[TAGS:]
            self._note(index, buffer[TAGS:])

    def end_step(self) -> None:
        """Close a step: its moments per layer (the global batch's in ``sync`` mode, where every
        rank sees the same after its allreduce; the rank's slice in ``local`` mode) go into the
        error sums the standard errors come from. No communication."""
        for step, errors in zip(self._step_totals, self.errors):
            accumulate_errors(step, errors)
            step.zero_()

    def worst_error(self) -> tuple[float, int, str] | None:
        """The largest standard error over every layer and channel so far, its layer index
        and which statistic (``mean``: std units, ``variance``: relative); None until every
        layer has two steps. In ``sync`` mode every rank computes it from the same global
        numbers, so every rank takes the same decision from it."""
        return worst_standard_error(self.totals, self.errors)

    def _note(self, call: int, packed: torch.Tensor) -> None:
        """Keep the sum of a call's packed float64 moments (after the allreduce in ``sync``
        mode): non-finite exactly when a value it summed was, on any rank. A few numbers per
        call, checked once per step by :meth:`first_non_finite`, so the pass is not slowed."""
        self._step_sums.append(packed.sum())
        self._step_calls.append(call)

    def first_non_finite(self) -> str | None:
        """The BN layer (or call without running statistics) that first saw a NaN or inf in
        the step just finished, on any rank in ``sync`` mode (every rank then names the same
        one), on this rank in ``local`` mode; None when the step was finite. Starts the next step."""
        sums, calls = self._step_sums, self._step_calls
        self._step_sums, self._step_calls = [], []
        if not sums:
            return None
        finite = torch.isfinite(torch.stack(sums))
        if bool(finite.all()):
            return None
        call = calls[int((~finite).nonzero()[0])]
        if call < 0:
            return f"a BN call without running statistics ({-call} channels)"
        layer = self.layers[call]
        return f"BN layer {layer.name!r} ({layer.class_name})"

    def moments(self) -> list[MomentStats]:
        """Combined statistics of every layer; in ``local`` mode this is the job's one allreduce."""
        if self.mode == "local" and not self._combined:
            # The job's one allreduce: every layer's moments and error sums in one buffer.
            buffer = torch.cat([*self.totals, *self.errors])
            self.collective.allreduce(buffer)
            parts = list(torch.split(buffer, [t.numel() for t in (*self.totals, *self.errors)]))
            self.totals, self.errors = parts[: len(self.totals)], parts[len(self.totals) :]
            self._combined = True
        for layer, total in zip(self.layers, self.totals):  # each step was checked: only overflowing sums are left
            if not bool(torch.isfinite(total).all()):
                raise DatasetError(
                    f"BN layer {layer.name!r} ({layer.class_name}) saw non-finite values (NaN or inf): "
                    "check the calibration data and the checkpoint's weights"
                )
        stats = []
        for total, shift, errors in zip(self.totals, self.shifts, self.errors):
            stat = finalize(total, shift)
            found = standard_errors(total, errors)
            if found is not None:
                stat.se_mean, stat.se_var = found
            stats.append(stat)
        return stats


def device_of(model: nn.Module) -> torch.device:
    """Where the model's tensors live (its first parameter's or buffer's device; the CPU if none)."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device("cpu")


@holds_tracing
def probe_call_order(
    model: nn.Module,
    layers: Sequence[BatchNormLayer],
    sample: Any,
    feed: Callable[[nn.Module, Any], Any] | None = None,
) -> list[int]:
    """The indices of ``layers`` in the order one calibrating forward normalises with them.

    Runs the model once on ``sample`` (through ``feed(model, sample)`` when given) with
    the layers in calibration mode (a world of one, nothing written to the model). Raises
    ``UnsupportedLayerError`` for a layer that cannot be calibrated and ``ModelInputError``
    when the model rejects the data (or ``feed`` fails: its message, one line).
    """
    was_training = model.training
    model.eval()
    sample = move_to(sample, device_of(model))  # the calibration pass moves its batches alike
    calibrator = BatchNormCalibrator(layers, "sync", SingleProcessCollective(), record_order=True)
    try:
        with torch.inference_mode(), calibrator:
            if feed is None:
                model(sample)
            else:
                feed(model, sample)
    except ModelInputError as exc:  # a BN layer's own check: the data's shape may say more
        hint = sample_shape_hint(model, tuple(sample.shape[1:])) if feed is None else ""
        if hint:
            raise ModelInputError(f"the model rejects samples of shape {tuple(sample.shape[1:])}: {hint} "
                                  f"({exc.message})") from exc
        raise
    except BnrecalError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here means the model or data do not fit
        culprit = calibrator.layer_in_progress()
        if culprit is not None:
            raise unsupported_layer(culprit, f"it failed: {first_line(exc)}") from exc
        if feed is not None:
            raise ModelInputError(f"forward(model, batch) failed: {type(exc).__name__}: {first_line(exc)}") from exc
        hint = sample_shape_hint(model, tuple(sample.shape[1:])) or first_line(exc)
        raise ModelInputError(f"the model rejects samples of shape {tuple(sample.shape[1:])}: {hint}") from exc
    finally:
        model.train(was_training)
    return list(calibrator.order)


class _Interceptor(TorchFunctionMode):
    """Routes batch-norm calls to the calibrator; every other call runs unchanged."""

    def __init__(self, calibrator: BatchNormCalibrator) -> None:
        super().__init__()
        self.calibrator = calibrator

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        form = BATCH_NORM_FORMS.get(func)
        if form is not None:
            result = self.calibrator.intercept(form, args, kwargs)
            if result is not None:
                return result
        return func(*args, **kwargs)


def _normalise(
    x: torch.Tensor, own: BatchMoments, stats: MomentStats, call: BatchNormCall, dtype: torch.dtype
) -> torch.Tensor:
    """The layer's output: its own ``F.batch_norm`` in eval form, with the calibration
    statistics. An input re-centred for precision is normalised from ``x - base``."""
    mean = stats.mean
    source = x
    if own.centred is not None and own.base is not None:
        source, mean = own.centred, mean - own.base
    return F.batch_norm(
        source,
        mean.to(dtype),
        stats.var.to(dtype),
        call.weight,
        call.bias,
        False,
        0.0,
        call.eps,
    )
