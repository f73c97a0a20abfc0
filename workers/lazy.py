"""Public names of a package, imported from their home module on first use: ``import
workers`` or ``import service`` stays cheap (no torch, no Ray) until a name is used."""

from __future__ import annotations

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
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__, sorted(module_of)
