"""The calibration modes, declared once for the engine, the job spec and the command line
(a module of its own so that declaring options loads neither torch nor Ray)."""

from __future__ import annotations

from typing import Literal, get_args

Mode = Literal["sync", "local"]
"""``sync``: statistics of the global batch across ranks (SyncBatchNorm); ``local``: each rank's own slice."""

MODES: tuple[str, ...] = get_args(Mode)
