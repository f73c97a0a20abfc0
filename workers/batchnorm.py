"""Finding BatchNorm layers and running them in calibration mode.

During a calibration pass every BN layer normalises with batch statistics (biased
variance), as in training, while the rest of the model stays in eval mode; each call
adds the float64 moments of its input to the layer's total. In ``sync`` mode the
batch statistics are those of the global batch: the call's packed moments go through
one allreduce before normalising. In ``local`` mode a rank uses its own slice, and the
totals of every layer go through one allreduce at the end of the pass.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .collectives import Collective
from .errors import ModelInputError, RunError
from .moments import MomentStats, ScratchSpace, finalize, packed_size, shifted_moments

MODES = ("sync", "local")


@dataclass
class BatchNormLayer:
    """A BN layer whose running statistics will be recalibrated."""

    name: str
    module: _BatchNorm

    @property
    def channels(self) -> int:
        """Number of channels (features) the layer normalises."""
        return int(self.module.num_features)


@dataclass
class SkippedLayer:
    """A BN layer left as it is, with the reason."""

    name: str
    reason: str


def find_batchnorm_layers(model: nn.Module) -> tuple[list[BatchNormLayer], list[SkippedLayer]]:
    """Every BatchNorm1d/2d/3d, SyncBatchNorm or subclass in ``model``, in module order.

    Layers without running statistics (``track_running_stats=False``) or still lazy
    are returned separately, with the reason, so the report can say why they were
    left alone.
    """
    layers: list[BatchNormLayer] = []
    skipped: list[SkippedLayer] = []
    for name, module in model.named_modules():
        if not isinstance(module, _BatchNorm):
            continue
        if not module.track_running_stats or module.running_mean is None:
            skipped.append(SkippedLayer(name, "track_running_stats=False: the layer keeps no running statistics"))
        elif isinstance(module.running_mean, nn.parameter.UninitializedBuffer):
            skipped.append(SkippedLayer(name, "lazy layer never initialised"))
        else:
            layers.append(BatchNormLayer(name, module))
    return layers, skipped


def record_call_order(model: nn.Module, layers: Sequence[BatchNormLayer], sample: torch.Tensor) -> list[int]:
    """The indices of ``layers`` in the order one forward pass calls them.

    Runs the model once in eval mode on ``sample``; this is also where a model that
    rejects the data's shape is caught, before any actor starts. A rank whose slice of
    a step is empty replays this order instead of running the model on zero samples.
    """
    index = {id(layer.module): i for i, layer in enumerate(layers)}
    order: list[int] = []
    hooks = [
        layer.module.register_forward_pre_hook(lambda m, _args: order.append(index[id(m)]))
        for layer in layers
    ]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            model(sample)
    except Exception as exc:  # noqa: BLE001 - any failure here means the data does not fit
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelInputError(
            f"the model rejects samples of shape {tuple(sample.shape[1:])}: {first_line}"
        ) from exc
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return order


@dataclass
class BatchNormCalibrator:
    """Context manager that puts a model's BN layers in calibration mode.

    While active, each layer's ``forward`` is replaced (on the instance) by one that
    normalises with batch statistics and accumulates moments; leaving the context
    restores the layers untouched. ``moments()`` then gives the combined float64
    statistics of every value each layer saw, across all ranks.
    """

    layers: Sequence[BatchNormLayer]
    mode: str
    collective: Collective
    call_order: Sequence[int] = ()
    _scratch: ScratchSpace = field(default_factory=ScratchSpace)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        self.shifts = [layer.module.running_mean.detach().double() for layer in self.layers]
        self.totals = [
            torch.zeros(packed_size(layer.channels), dtype=torch.float64, device=shift.device)
            for layer, shift in zip(self.layers, self.shifts)
        ]
        self.calls = [0] * len(self.layers)
        self._combined = False

    def __enter__(self) -> BatchNormCalibrator:
        for i, layer in enumerate(self.layers):
            layer.module.forward = types.MethodType(self._make_forward(i), layer.module)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for layer in self.layers:
            layer.module.__dict__.pop("forward", None)

    def _make_forward(self, index: int) -> Callable[[_BatchNorm, torch.Tensor], torch.Tensor]:
        def forward(module: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
            return self._calibrating_forward(index, module, x)

        return forward

    def _calibrating_forward(self, index: int, module: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != module.num_features:
            raise ModelInputError(
                f"BN layer {self.layers[index].name!r} expects {module.num_features} channels in "
                f"dimension 1, got input of shape {tuple(x.shape)}"
            )
        shift = self.shifts[index]
        packed, centred, step_mean = shifted_moments(x, shift, self._scratch)
        if self.mode == "sync":
            self.collective.allreduce(packed)
        self.totals[index] += packed
        self.calls[index] += 1
        stats = finalize(packed, shift)
        if x.numel() == 0 or stats.count == 0:
            return x.clone()
        return _normalise(module, centred, step_mean, stats)

    def replay_empty_step(self) -> None:
        """Take part in a step with no local samples: the same collectives, zero moments."""
        if self.mode != "sync":
            return
        if not self.call_order:
            raise RunError("an empty slice needs the model's BN call order, which was not recorded")
        for index in self.call_order:
            packed = torch.zeros_like(self.totals[index])
            self.collective.allreduce(packed)
            self.totals[index] += packed

    def moments(self) -> list[MomentStats]:
        """Combined statistics of every layer; in ``local`` mode this is the job's one allreduce."""
        if self.mode == "local" and not self._combined:
            buffer = torch.cat(self.totals)
            self.collective.allreduce(buffer)
            self.totals = list(torch.split(buffer, [t.numel() for t in self.totals]))
            self._combined = True
        return [finalize(total, shift) for total, shift in zip(self.totals, self.shifts)]


def _normalise(
    module: _BatchNorm, centred: torch.Tensor, step_mean: torch.Tensor, stats: MomentStats
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` computed from the centred input.

    Working from ``x - step_mean`` (exact in float32) and folding the small float64
    correction ``step_mean - mean`` into the offset keeps the output accurate even for
    inputs whose mean dwarfs their spread.
    """
    scale = torch.rsqrt(stats.var + module.eps)
    if module.weight is not None:
        scale = scale * module.weight.detach().double()
    offset = (step_mean.double() - stats.mean) * scale
    if module.bias is not None:
        offset = offset + module.bias.detach().double()
    view_shape = (1, -1) + (1,) * (centred.dim() - 2)
    return torch.addcmul(
        offset.to(centred.dtype).view(view_shape), centred, scale.to(centred.dtype).view(view_shape)
    )
