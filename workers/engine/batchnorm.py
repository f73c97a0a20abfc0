"""Finding the BatchNorm layers of a model: any ``BatchNorm1d/2d/3d``, ``SyncBatchNorm``
or subclass with running statistics, and the ones left alone with their reason.

A layer is its running buffers: a module's BN layer owns them itself, a ``torch.export``
program's (``workers.programs``) sit in containers at the layer's module path. Either
way the calibrator recognises the layer's normalising call by those buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from bnrecal.workers.engine.modes import MODES
from bnrecal.errors import NoBatchNormError, RunError, UnsupportedLayerError

__all__ = [
    "MODES", "BatchNormLayer", "SkippedLayer", "find_batchnorm_layers", "layers_named", "unsupported_layer",
]


@dataclass
class BatchNormLayer:
    """A BN layer whose running statistics will be recalibrated.

    ``owner`` holds the running buffers (``running_mean``, ``running_var`` and, when there
    is one, ``num_batches_tracked``); for a module's layer it is the BN module itself.
    The buffers are looked up on the owner at each use, so moving the model to another
    device or layout keeps the layer pointing at the live tensors.
    """

    name: str
    owner: nn.Module
    kind: str = ""
    eps: float | None = None
    mean_name: str = "running_mean"
    var_name: str = "running_var"

    @property
    def module(self) -> _BatchNorm | None:
        """The BN module, for a module's layer (None for a program's)."""
        return self.owner if isinstance(self.owner, _BatchNorm) else None

    @property
    def running_mean(self) -> torch.Tensor:
        """The live ``running_mean`` buffer."""
        return getattr(self.owner, self.mean_name)

    @property
    def running_var(self) -> torch.Tensor:
        """The live ``running_var`` buffer."""
        return getattr(self.owner, self.var_name)

    @property
    def num_batches_tracked(self) -> torch.Tensor | None:
        """The live ``num_batches_tracked`` buffer, or None where the layer has none."""
        return getattr(self.owner, "num_batches_tracked", None)

    def buffer_names(self) -> dict[str, str]:
        """The state-dict name of each of the layer's buffers, by role (what a
        recalibration changes in the checkpoint or program)."""
        prefix = f"{self.name}." if self.name else ""
        names = {"running_mean": prefix + self.mean_name, "running_var": prefix + self.var_name}
        if self.num_batches_tracked is not None:
            names["num_batches_tracked"] = prefix + "num_batches_tracked"
        return names

    @property
    def channels(self) -> int:
        """Number of channels (features) the layer normalises."""
        return int(self.running_mean.numel())

    @property
    def epsilon(self) -> float:
        """The layer's eps (what its normalisation adds to the variance)."""
        if self.eps is not None:
            return float(self.eps)
        return float(getattr(self.owner, "eps", 1e-5))

    @property
    def class_name(self) -> str:
        """The layer's class, as the report shows it (``BatchNormAct2d``, ``SyncBatchNorm``)."""
        return self.kind or type(self.owner).__name__


@dataclass
class SkippedLayer:
    """A BN layer left as it is, with the reason."""

    name: str
    reason: str


def find_batchnorm_layers(model: nn.Module) -> tuple[list[BatchNormLayer], list[SkippedLayer]]:
    """Every BatchNorm1d/2d/3d, SyncBatchNorm or subclass in ``model``, in module order
    (a ``torch.export`` program's batch-norm calls, for a program module).

    Layers without running statistics (``track_running_stats=False``) or still lazy
    are returned separately, with the reason, so the report can say why they were
    left alone.
    """
    own = getattr(model, "batchnorm_layers", None)
    if callable(own):
        return own()
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


def require_batchnorm_layers(model: nn.Module, label: str) -> tuple[list[BatchNormLayer], list[SkippedLayer]]:
    """``find_batchnorm_layers``, refusing a model with nothing to recalibrate: every surface
    checks this before it reads data or exports, with the same message (``label`` names the
    model as its user gave it)."""
    layers, skipped = find_batchnorm_layers(model)
    if not layers:
        detail = f" ({len(skipped)} without running statistics)" if skipped else ""
        raise NoBatchNormError(f"{label} has no BatchNorm layer to recalibrate{detail}")
    return layers, skipped


def layers_named(model: nn.Module, names: Sequence[str]) -> list[BatchNormLayer]:
    """The BN layers of ``model`` called ``names``, in that order (a rank rebuilding the
    driver's list of layers from their names)."""
    found = {layer.name: layer for layer in find_batchnorm_layers(model)[0]}
    missing = [name for name in names if name not in found]
    if missing:
        raise RunError(f"the model has no BN layer named {missing[0]!r} (the driver's model and this one differ)")
    return [found[name] for name in names]


def unsupported_layer(layer: BatchNormLayer, detail: str = "") -> UnsupportedLayerError:
    """The error for a layer whose forward does not normalise through a batch-norm call
    with its running buffers."""
    cls = type(layer.owner)
    suffix = f" ({detail})" if detail else ""
    return UnsupportedLayerError(
        f"BN layer {layer.name!r} of class {cls.__module__}.{cls.__qualname__} cannot be calibrated: its forward "
        "does not normalise through torch.nn.functional.batch_norm, torch.batch_norm or an aten batch-norm "
        f"op with its running buffers{suffix}",
        layer=layer.name,
        layer_class=cls.__qualname__,
    )
