"""Python's cycle collector over a job command's start-up, in the ``bnrecal`` script's own process.

Before its first sample, ``bnrecal calibrate`` (or ``sweep``) imports torch, torchvision,
onnx and the run pipeline: a few hundred thousand objects, none of them garbage, and every
full collection while they load walks all that loaded before. The small job of
``bench/wall_time.py`` spent 0.44 s in six such collections, four times its statistics pass.

So the script (``bnrecal.service.cli.script``, where this process is ours) pauses the
collector as it starts; a job command resumes it when its job's first phase after starting
begins (``resumed_at_first_phase``: the imports are done, the model is built; ``sweep
--server``, whose job runs on the server, before it uploads), having first
moved what start-up made to the permanent generation (``gc.freeze``: it lives as long as
the process, so no later collection walks it). The cyclic garbage start-up left stays with
it, a bounded cost paid once: about 10k objects for a torchvision model's job, where one
collection to free them would take 0.24 s back. Every other command resumes it before it
does anything (``main``'s callback). ``main`` called from Python (tests, a user's script)
never pauses it, and the Python API holds it off only while a public name's first use imports
its modules (``workers.lazy``), leaving it on or off as it was: a user's process is not ours.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from bnrecal.service.run.options import STARTING_PHASE

JOB_COMMANDS = frozenset({"calibrate", "sweep"})
"""The commands that keep the collector paused until their job's first phase after starting."""

_paused = False


def pause() -> None:
    """Pause the collector for a job command's start-up (the ``bnrecal`` script only)."""
    global _paused
    gc.disable()
    _paused = True


def resume() -> None:
    """End start-up: freeze what it made out of later collections and resume the collector
    (nothing when it was not paused here, as for ``main`` called from Python)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


def resumed_at_first_phase(update: Callable[..., None]) -> Callable[..., None]:
    """``update`` (a job's progress callback), resuming the collector when the job reports a
    phase other than starting its workers (its first samples, or its outputs)."""

    def progress(done: int, total: int | None = None, phase: str = STARTING_PHASE) -> None:
        if _paused and not phase.startswith(STARTING_PHASE):
            resume()
        update(done, total, phase)

    return progress
