"""Finding the BatchNorm layers of a model: any ``BatchNorm1d/2d/3d``, ``SyncBatchNorm``
or subclass with running statistics, and the ones left alone with their reason."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .errors import UnsupportedLayerError
from .modes import MODES

__all__ = ["MODES", "BatchNormLayer", "SkippedLayer", "find_batchnorm_layers", "unsupported_layer"]


@dataclass
class BatchNormLayer:
    """A BN layer whose running statistics will be recalibrated."""

    name: str
    module: _BatchNorm

    @property
    def channels(self) -> int:
        """Number of channels (features) the layer normalises."""
        return int(self.module.num_features)

    @property
    def class_name(self) -> str:
        """The layer's class, as the report shows it (``BatchNormAct2d``, ``SyncBatchNorm``)."""
        return type(self.module).__name__


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


def unsupported_layer(layer: BatchNormLayer, detail: str = "") -> UnsupportedLayerError:
    """The error for a layer whose forward does not normalise through ``F.batch_norm``."""
    cls = type(layer.module)
    suffix = f" ({detail})" if detail else ""
    return UnsupportedLayerError(
        f"BN layer {layer.name!r} of class {cls.__module__}.{cls.__qualname__} cannot be calibrated: its forward "
        f"does not normalise through torch.nn.functional.batch_norm with its running buffers{suffix}",
        layer=layer.name,
        layer_class=cls.__qualname__,
    )
