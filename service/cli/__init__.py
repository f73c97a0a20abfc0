"""The ``bnrecal`` command line, in a room of its own: ``main`` (the app and entry point),
``local`` (calibrate, export), ``remote`` (serve, submit), ``jobs`` and ``job_text`` (the
job commands and what they print), ``storage`` (gc, delete), ``options`` (the flags the
commands share), ``console`` (one-line errors, summaries) and ``collector`` (Python's cycle
collector over a job command's start-up).

Declaring the commands imports no torch, Ray or run pipeline (see ``options``), so
``bnrecal --help``, the job commands and every argument error answer in a fraction of a
second; a command imports what runs a model inside its function, once its flags are checked."""

from __future__ import annotations

from .main import app, main, script

__all__ = ["app", "main", "script"]
