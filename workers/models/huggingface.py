"""Hugging Face ``transformers`` models as a model source: ``transformers:<ModelClass>``
(docs/models.md, "Hugging Face transformers").

The model is built from its configuration alone: ``model_kwargs`` is the content of the
``config.json`` that ``save_pretrained`` writes, turned into the class's own config with
``ModelClass.config_class.from_dict`` and passed to ``ModelClass(config)``. Its weights
are random until the checkpoint (the ``model.safetensors`` of ``save_pretrained``) is
loaded into it. ``from_pretrained`` is never called and the hub is never asked:

- only classes that ship with the installed ``transformers`` are built (a public
  ``PreTrainedModel`` subclass of the package; never ``trust_remote_code``);
- a config that names code to fetch and run (``auto_map``, ``trust_remote_code``,
  ``custom_pipelines``), pretrained backbone weights (``use_pretrained_backbone``) or a
  backbone to look up by hub id (``backbone`` without ``backbone_config``; a timm name
  that is not plain, such as ``hf-hub:...``) is refused before anything is built;
- the build itself runs with the hub client switched offline (:func:`hub_offline`), so a
  key this module does not know of cannot reach the network either.

``transformers`` is an optional extra (``pip install 'bnrecal[transformers]'``); nothing
here imports it until a ``transformers:`` reference is used.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from torch import nn

from bnrecal.errors import ArchitectureError, SpecError, one_line
from bnrecal.workers.suggestions import did_you_mean

SOURCE = "transformers"
EXTRA = "pip install 'bnrecal[transformers]'"

_CLASS_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_PLAIN_TIMM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")  # no 'hf-hub:' or 'local-dir:', no path
_CODE_KEYS = ("auto_map", "trust_remote_code", "custom_pipelines")
_TIMM_NAME_KEYS = {"timm_backbone": "backbone", "timm_wrapper": "architecture"}
_PYTORCH_MODELING_MODULE = re.compile(r"(^|\.)modeling_(?!tf_|flax_)")


def transformers_package(name: str) -> ModuleType:
    """The ``transformers`` package, or an error naming the extra that installs it."""
    try:
        import transformers
    except ImportError as exc:
        raise ArchitectureError(
            f"{SOURCE}:{name} needs transformers, which is not installed: install the optional extra with {EXTRA}"
        ) from exc
    return transformers


@functools.cache
def _model_class_names(transformers: ModuleType) -> tuple[str, ...]:
    """Names of the PyTorch model classes the package exports, read from its lazy-import
    table without importing any model's code (the candidates of a 'did you mean')."""
    table = getattr(transformers, "_class_to_module", None)
    if not isinstance(table, Mapping):
        return tuple(n for n in dir(transformers) if n[:1].isupper())
    return tuple(
        sorted(
            name
            for name, module in table.items()
            if _PYTORCH_MODELING_MODULE.search(str(module)) and not name.startswith(("TF", "Flax", "Auto"))
        )
    )


def is_model_class_name(name: str) -> bool:
    """Whether ``name`` is a model class of the installed transformers (False without it),
    read from its lazy-import table: a hint for an ``arch`` given without its source."""
    if not _CLASS_NAME.fullmatch(name):
        return False
    try:
        import transformers
    except ImportError:
        return False
    return name in _model_class_names(transformers)


def model_class(name: str) -> type[nn.Module]:
    """The ``PreTrainedModel`` subclass that ``transformers`` exports as ``name``.

    This is the whole check of a ``transformers:`` reference at submission: it imports
    that model's code (a second or two the first time in a process) and builds nothing.
    Anything else (an unknown name, a config, an Auto class, a function) is refused with
    an :class:`ArchitectureError` suggesting close model class names.
    """
    transformers = transformers_package(name)
    candidates = _model_class_names(transformers)
    if not _CLASS_NAME.fullmatch(name):
        raise ArchitectureError(
            f"{SOURCE}:{name} is not a class name: name a model class such as ResNetForImageClassification"
        )
    if name not in dir(transformers):  # the lazy module lists every export without importing it
        raise ArchitectureError(f"unknown transformers model class {name!r}{did_you_mean(name, candidates)}")
    try:
        found = getattr(transformers, name)
    except Exception as exc:  # noqa: BLE001 - e.g. a model whose code needs a package that is missing
        raise ArchitectureError(f"transformers cannot import {name}: {one_line(exc)}") from exc
    if inspect.isclass(found) and issubclass(found, transformers.PreTrainedModel):
        if getattr(found, "config_class", None) is None:
            raise ArchitectureError(
                f"transformers.{name} is a base class without a config class: name a concrete model class "
                "such as ResNetForImageClassification"
            )
        return found
    raise ArchitectureError(_not_a_model(transformers, name, found, candidates))


def _not_a_model(transformers: ModuleType, name: str, found: Any, candidates: tuple[str, ...]) -> str:
    """Why ``transformers.<name>`` is not a model class, and what to name instead."""
    if inspect.isclass(found) and name.startswith("Auto"):
        return (
            f"transformers.{name} is an Auto class, which picks a model class from a config; name that class "
            "itself (config.json's \"architectures\" lists it), e.g. transformers:ResNetForImageClassification"
        )
    if inspect.isclass(found) and issubclass(found, transformers.PretrainedConfig):
        return (
            f"transformers.{name} is a configuration class, not a model: name the model class and give "
            f"config.json's content as model_kwargs{did_you_mean(name, candidates)}"
        )
    kind = (
        "class" if inspect.isclass(found)
        else "module" if inspect.ismodule(found)
        else "function" if callable(found)
        else type(found).__name__
    )
    return (
        f"transformers.{name} is a {kind}, not a model class (a PreTrainedModel subclass)"
        f"{did_you_mean(name, candidates)}"
    )


def check_config(name: str, config: Mapping[str, Any], model_type: str | None) -> None:
    """Refuse a config (``model_kwargs``) that would fetch or run anything, or that is
    another model's: the reason names the key, nested keys with their path."""
    _check_entries(config, "model_kwargs")
    declared = config.get("model_type")
    if isinstance(declared, str) and model_type and declared != model_type:
        listed = config.get("architectures")
        hint = f" (config.json's \"architectures\": {', '.join(map(str, listed))})" if isinstance(listed, list) else ""
        raise SpecError(
            f"model_kwargs is the config of a {declared!r} model, but {SOURCE}:{name} takes model_type "
            f"{model_type!r}; name that model's class{hint}",
            field="model_kwargs",
        )


def _check_entries(value: Any, path: str) -> None:
    """Walk a config's nested objects and lists, refusing the keys that reach outside it."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check_entries(item, f"{path}[{index}]")
        return
    if not isinstance(value, Mapping):
        return
    for key, item in value.items():
        where = f"{path}.{key}"
        if key in _CODE_KEYS and item:
            raise SpecError(
                f"{where} is not allowed: it names code to download and run; bnrecal builds only model "
                "classes that ship with transformers, never remote code",
                field="model_kwargs",
            )
        if key == "use_pretrained_backbone" and item:
            raise SpecError(
                f"{where} is not allowed: it downloads pretrained backbone weights; weights come from the "
                "uploaded checkpoint (set it to false)",
                field="model_kwargs",
            )
        if isinstance(item, str) and item:
            _check_named_model(value, key, item, where)
        _check_entries(item, where)


def _check_named_model(config: Mapping[str, Any], key: str, value: str, where: str) -> None:
    """Refuse a model named by a hub id or a timm reference that would be fetched."""
    timm_key = _TIMM_NAME_KEYS.get(str(config.get("model_type")))
    if key == timm_key:
        if not _PLAIN_TIMM_NAME.fullmatch(value):
            raise SpecError(
                f"{where} {value!r} is not a plain timm model name (hub and file references are not allowed)",
                field="model_kwargs",
            )
    elif key == "backbone" and config.get("backbone_config") is None:
        raise SpecError(
            f"{where} {value!r} names a backbone that transformers would look up on the Hugging Face hub; "
            "give the backbone's own config under backbone_config instead",
            field="model_kwargs",
        )


def build_transformers_model(name: str, kwargs: Mapping[str, Any]) -> nn.Module:
    """Build ``transformers:<name>`` from its config (``kwargs``, the content of config.json),
    with random weights, offline; errors name ``arch`` or ``model_kwargs``."""
    cls = model_class(name)
    config_class = cls.config_class
    check_config(name, kwargs, getattr(config_class, "model_type", None) or None)
    try:
        with hub_offline():
            config = config_class.from_dict(dict(kwargs))
    except Exception as exc:  # noqa: BLE001 - the config's own validation, in one line
        raise SpecError(
            f"model_kwargs do not make a {config_class.__name__} for {SOURCE}:{name}: {one_line(exc)}",
            field="model_kwargs",
        ) from exc
    try:
        with hub_offline():
            model = cls(config)
    except Exception as exc:  # noqa: BLE001 - the config is the only input, so it is what to fix
        raise SpecError(
            f"{SOURCE}:{name} cannot be built from model_kwargs: {one_line(exc)}", field="model_kwargs"
        ) from exc
    return model


_offline_lock = threading.Lock()
_offline_depth = 0
_offline_saved: Any = None


@contextmanager
def hub_offline() -> Iterator[None]:
    """Switch the Hugging Face hub client offline for the duration (nested and threaded
    uses keep it off until the last one ends): a request then fails at once instead of
    fetching a file, whatever part of transformers or timm makes it."""
    global _offline_depth, _offline_saved
    try:
        from huggingface_hub import constants
    except ImportError:  # no hub client installed: nothing can reach the hub
        yield
        return
    with _offline_lock:
        if _offline_depth == 0:
            _offline_saved = constants.HF_HUB_OFFLINE
            constants.HF_HUB_OFFLINE = True
        _offline_depth += 1
    try:
        yield
    finally:
        with _offline_lock:
            _offline_depth -= 1
            if _offline_depth == 0:
                constants.HF_HUB_OFFLINE = _offline_saved
