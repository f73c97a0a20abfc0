"""bnrecal in a Lightning Trainer: ``BNRecalibration``, a callback that recalibrates the
module's BatchNorm statistics at the end of fit (after SWA's average is in place), every N
epochs or before validation, on the Trainer's own ranks (docs/training.md, "Lightning").

    from bnrecal.lightning import BNRecalibration
    trainer = Trainer(callbacks=[StochasticWeightAveraging(1e-2), BNRecalibration()])

Needs Lightning (``pip install 'bnrecal[lightning]'``); ``import bnrecal`` never imports this.
``BNRecalibration`` subclasses ``lightning.pytorch.Callback`` (else ``pytorch_lightning``'s, where
only that one is installed); ``BNRecalibration.for_package("pytorch_lightning")`` is the other.
"""

from __future__ import annotations

from bnrecal.service.live.lightning import GateSection, callback_class, installed_package

BNRecalibration = callback_class(installed_package())

__all__ = ["BNRecalibration", "GateSection"]
