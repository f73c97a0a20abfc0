"""Public names of a package, imported from their home module on first use: ``import
workers`` or ``import service`` stays cheap (no torch, no Ray) until a name is used."""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, Sequence[str]]) -> tuple[Callable[[str], Any], list[str]]:
    """A module ``__getattr__`` for ``package`` and its ``__all__``, from ``{module: names}``."""
    module_of = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(_imported(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__, sorted(module_of)


def _imported(module: str) -> Any:
    """``module`` imported with the cyclic garbage collector held off, as it was before after:
    in a process that holds torch and a torchvision model (about 350k objects) the objects an
    import makes trigger a full collection that finds next to nothing and costs 0.17 s, half
    of the first ``bnrecal.recalibrate``'s import (docs/benchmarks.md, "Start-up without the cycle collector")."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(module)
    finally:
        if enabled:
            gc.enable()
