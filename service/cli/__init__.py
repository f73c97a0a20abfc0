"""The ``bnrecal`` command line, in a room of its own: ``main`` (the app and entry point),
``local`` (calibrate, export), ``remote`` (serve, submit), ``options`` (the flags the
commands share) and ``console`` (progress and one-line errors)."""

from __future__ import annotations

from .main import app, main

__all__ = ["app", "main"]
