"""A rank process's start-up without Python's cycle collector walking it.

A rank's process imports torch, Ray's collective and the engine before its actor is built:
a few hundred thousand objects that live as long as the process, which every full
collection while they load walks again (about 0.25 s of a rank's 2 s start here). The
process is ours alone (Ray starts one for each rank actor, with ``RANK_PROCESS`` in its
environment), so the actor's module pauses the collector before its imports (``pause``),
and the actor resumes it once it is built (``resume``), having frozen what start-up made
(``gc.freeze``: no later collection walks it). In any other process (a driver, a user's
own Ray worker that imports the module) neither does anything.
"""

from __future__ import annotations

import gc
import os

RANK_PROCESS = {"BNRECAL_RANK_PROCESS": "1"}
"""The mark in a rank process's environment (its actor's Ray runtime environment)."""

_paused = False


def pause() -> None:
    """In a rank's own process, pause the collector for its start-up."""
    global _paused
    if all(os.environ.get(name) == value for name, value in RANK_PROCESS.items()) and gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """The rank is built: freeze what start-up made and resume the collector (once)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
