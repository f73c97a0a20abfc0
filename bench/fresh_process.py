"""The environment of a command a bench times as a user runs it, in a fresh process."""

from __future__ import annotations

import os


def user_environment() -> dict[str, str]:
    """This shell's environment as a user's would be: no Ray address (each command starts or
    finds its own), and Python's bytecode cache on, as an install has it (pip compiles a
    wheel's modules as it installs them, an editable checkout writes them on its first
    import; a shell with ``PYTHONDONTWRITEBYTECODE`` set would compile bnrecal's hundred
    modules in every process, 0.08-0.1 s, but not torch's, which pip compiled)."""
    skipped = ("RAY_ADDRESS", "BNRECAL_RAY_ADDRESS", "PYTHONDONTWRITEBYTECODE")
    return {key: value for key, value in os.environ.items() if key not in skipped}
