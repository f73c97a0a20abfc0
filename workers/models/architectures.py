"""Build untrained models from an architecture reference (docs/models.md, "Named architectures").

Four forms are accepted:

- ``torchvision:<name>`` -> ``torchvision.models.get_model(name, weights=None, **kwargs)``
- ``timm:<name>`` -> ``timm.create_model(name, pretrained=False, **kwargs)`` (optional extra)
- ``transformers:<ModelClass>`` -> ``ModelClass(ModelClass.config_class.from_dict(kwargs))``,
  kwargs being config.json's content (optional extra; see ``workers.models.huggingface``)
- ``<module.path>:<callable>`` -> a factory in a module the operator allowed through the
  setting ``BNRECAL_MODEL_MODULES``.

Weights never come from here: every download switch is forced off, and the weights are
loaded afterwards from the user's checkpoint. Nothing is ever ``exec``'d or ``eval``'d.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import keyword
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from bnrecal.errors import ArchitectureError, SpecError, one_line
from bnrecal.workers.models.huggingface import build_transformers_model, is_model_class_name, model_class
from bnrecal.workers.suggestions import did_you_mean as _suggestion

ALLOWED_MODULES_SETTING = "BNRECAL_MODEL_MODULES"

ACCEPTED_FORMS = (
    "'torchvision:<name>', 'timm:<name>', 'transformers:<ModelClass>' or '<module.path>:<callable>'"
)

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED_NAME = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*")

# kwargs that would download or read weights from somewhere other than the checkpoint.
_TORCHVISION_WEIGHT_KWARGS = ("weights", "weights_backbone", "pretrained", "pretrained_backbone")
_TIMM_WEIGHT_KWARGS = (
    "pretrained",
    "pretrained_cfg",
    "pretrained_cfg_overlay",
    "checkpoint_path",
    "weights",
)


def parse_allowed_modules(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """Split the operator setting BNRECAL_MODEL_MODULES (comma-separated) into clean prefixes.

    Blank entries are dropped, surrounding whitespace and trailing dots removed, and
    duplicates collapsed, so ``" pkg., other ,,pkg"`` means ``("pkg", "other")``. An entry
    that is not a dotted module name (a glob, a path) is refused rather than guessed at.
    """
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else [
        part for item in value for part in str(item).split(",")
    ]
    prefixes: list[str] = []
    for item in items:
        prefix = item.strip().rstrip(".")
        if not prefix:
            continue
        if not _DOTTED_NAME.fullmatch(prefix):
            raise SpecError(
                f"{ALLOWED_MODULES_SETTING} entry {item.strip()!r} is not a dotted module name "
                "(e.g. 'mypkg' or 'mypkg.models')",
                field=ALLOWED_MODULES_SETTING,
            )
        if prefix not in prefixes:
            prefixes.append(prefix)
    return tuple(prefixes)


def build_model(
    arch: str,
    model_kwargs: Mapping[str, Any] | None = None,
    *,
    allowed_modules: Sequence[str] = (),
    device: str = "cpu",
) -> torch.nn.Module:
    """Build an untrained model from an architecture reference (docs/models.md, "Named architectures").

    The model comes back in float32 on ``device`` (the CPU; ``meta`` to know its shapes
    without memory, built under ``torch.device("meta")``), with random weights: the
    checkpoint is loaded into it afterwards. Errors name the reference, the setting or the
    field to fix.
    """
    source, name = check_architecture(arch, allowed_modules)
    kwargs = _clean_kwargs(model_kwargs)
    if source == "torchvision":
        model = _build_torchvision(name, kwargs)
    elif source == "timm":
        model = _build_timm(name, kwargs)
    elif source == "transformers":
        model = build_transformers_model(name, kwargs)
    else:
        model = _build_from_module(arch, source, name, kwargs, allowed_modules)
    return model.to(device=device, dtype=torch.float32)


MAX_KWARGS_DEPTH = 8
"""How deep a ``model_kwargs`` value may nest lists and objects (a transformers config's
sub-configs nest 3 or 4): deeper is no model's configuration."""


def _clean_kwargs(model_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate ``model_kwargs`` as a JSON-like object with string keys and copy it."""
    if model_kwargs is None:
        return {}
    check_model_kwargs(model_kwargs)
    return dict(model_kwargs)


def check_model_kwargs(model_kwargs: Mapping[str, Any]) -> None:
    """Refuse ``model_kwargs`` that no factory could take, naming ``model_kwargs.<key>``: a key
    that cannot be a Python argument name (not an identifier, a keyword such as ``class``, a
    dunder such as ``__class__``) or a value nested deeper than ``MAX_KWARGS_DEPTH``.

    Cheap and without the architecture, so submission runs it before anything is built.
    """
    if not isinstance(model_kwargs, Mapping):
        raise SpecError(
            f"model_kwargs must be a JSON object, got {type(model_kwargs).__name__}", field="model_kwargs"
        )
    for key, value in model_kwargs.items():
        why = _not_an_argument_name(key)
        if why:
            raise SpecError(f"model_kwargs key {key!r} is {why}", field=f"model_kwargs.{key}")
        if _nests_deeper(value, MAX_KWARGS_DEPTH):
            raise SpecError(
                f"model_kwargs.{key} nests lists and objects deeper than {MAX_KWARGS_DEPTH} levels",
                field=f"model_kwargs.{key}",
            )


def _not_an_argument_name(key: object) -> str | None:
    """Why ``key`` cannot be a keyword argument's name, or None when it can."""
    if not isinstance(key, str):
        return f"a {type(key).__name__}, not an argument name"
    if not key.isidentifier():
        return "not an argument name (letters, digits and _, not starting with a digit)"
    if keyword.iskeyword(key):
        return "a Python keyword, not an argument name"
    if key.startswith("__") and key.endswith("__"):
        return "a reserved (dunder) name, not an argument name"
    return None


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists, tuples and mappings more than ``limit`` levels deep
    (walking at most ``limit + 1`` levels down, however deep it goes)."""
    if not isinstance(value, (Mapping, list, tuple)):
        return False
    if limit == 0:
        return True
    children = value.values() if isinstance(value, Mapping) else value
    return any(_nests_deeper(child, limit - 1) for child in children)


def _refuse_weight_kwargs(arch: str, kwargs: Mapping[str, Any], names: Sequence[str]) -> None:
    """Refuse kwargs that would fetch pretrained weights instead of using the checkpoint."""
    for key in names:
        if key in kwargs and kwargs[key] not in (None, False):
            raise SpecError(
                f"model_kwargs.{key} is not allowed for {arch}: weights come from the "
                "uploaded checkpoint, never from a download",
                field="model_kwargs",
            )


def _torchvision_builder(name: str) -> Callable[..., Any]:
    """torchvision's builder for ``name``, or an error suggesting close names."""
    import torchvision

    available = torchvision.models.list_models()
    if name not in available:
        raise ArchitectureError(f"unknown torchvision model {name!r}{_suggestion(name, available)}")
    return torchvision.models.get_model_builder(name)


def _build_torchvision(name: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    """Build ``torchvision:<name>`` with every weight download switched off."""

    arch = f"torchvision:{name}"
    builder = _torchvision_builder(name)
    _refuse_weight_kwargs(arch, kwargs, _TORCHVISION_WEIGHT_KWARGS)
    kwargs = {k: v for k, v in kwargs.items() if k not in _TORCHVISION_WEIGHT_KWARGS}
    parameters = _signature_parameters(builder)
    if parameters is not None and "weights_backbone" in parameters:
        # Detection/segmentation builders default to downloading a pretrained backbone.
        kwargs["weights_backbone"] = None
    return _call_factory(arch, lambda **kw: builder(weights=None, **kw), kwargs, builder)


def _timm_module(name: str) -> Any:
    """The timm package, once ``name`` is known to be one of its models; else a clear error."""
    try:
        import timm
    except ImportError as exc:
        raise ArchitectureError(
            f"timm:{name} needs timm, which is not installed: install the optional extra "
            "with pip install 'bnrecal[timm]'",
        ) from exc
    if not _DOTTED_NAME.fullmatch(name.replace("-", "_")):
        raise ArchitectureError(
            f"timm model name {name!r} is not a plain model name (hub references are not allowed)"
        )
    if not timm.is_model(name):
        raise ArchitectureError(f"unknown timm model {name!r}{_suggestion(name, timm.list_models())}")
    return timm


def _build_timm(name: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    """Build ``timm:<name>`` without pretrained weights; needs the ``bnrecal[timm]`` extra."""
    arch = f"timm:{name}"
    timm = _timm_module(name)
    _refuse_weight_kwargs(arch, kwargs, _TIMM_WEIGHT_KWARGS)
    kwargs = {k: v for k, v in kwargs.items() if k not in _TIMM_WEIGHT_KWARGS}
    return _call_factory(
        arch, lambda **kw: timm.create_model(name, pretrained=False, **kw), kwargs, None
    )


def check_architecture(arch: str, allowed_modules: Sequence[str] = ()) -> tuple[str, str]:
    """Refuse a malformed reference, or a module outside the operator's allowlist, before
    anything is imported; returns ``(source, name)``. The HTTP API calls this at
    submission, ``build_model`` before building."""
    if not isinstance(arch, str):
        raise ArchitectureError(f"arch must be a string of the form {ACCEPTED_FORMS}")
    source, sep, name = arch.strip().partition(":")
    if not sep or not source or not name:
        raise ArchitectureError(f"arch {arch!r} is malformed; use {ACCEPTED_FORMS}{_bare_name_hint(arch)}")
    if source in ("torchvision", "timm", "transformers"):
        return source, name
    if not _DOTTED_NAME.fullmatch(source) or not _DOTTED_NAME.fullmatch(name):
        raise ArchitectureError(f"arch {arch!r} is malformed; use {ACCEPTED_FORMS}")
    if not _is_allowed(source, allowed_modules):
        allowed = ", ".join(parse_allowed_modules(allowed_modules)) or "none"
        near = _near_source(source, allowed_modules)
        if near in KNOWN_SOURCES:  # a typo of torchvision, timm or transformers, not a module to allow
            raise ArchitectureError(f"arch {arch!r}: unknown model source {source!r} (did you mean {near}:{name}?)")
        hint = f" (did you mean {near}:{name}?)" if near else ""
        raise ArchitectureError(
            f"module {source!r} is not allowed{hint} (allowed prefixes: {allowed}); the operator "
            f"must list it in the setting {ALLOWED_MODULES_SETTING}"
        )
    return source, name


KNOWN_SOURCES = ("torchvision", "timm", "transformers")


def _near_source(source: str, allowed_modules: Sequence[str]) -> str | None:
    """The known source (``torchvision`` for ``torvision``) or allowed module path (``tests.nets``
    for ``test.nets``) that ``source`` is a near miss of, or None."""
    allowed = parse_allowed_modules(allowed_modules)
    head, dot, rest = source.partition(".")
    candidates = [known for known in KNOWN_SOURCES if not dot] + [prefix.split(".")[0] for prefix in allowed]
    match = difflib.get_close_matches(head, candidates, n=1, cutoff=0.75)
    if not match and head.lower() in candidates:
        match = [head.lower()]
    if not match or match[0] == head:
        return None
    fixed = match[0] + dot + rest
    return fixed if fixed in KNOWN_SOURCES or _is_allowed(fixed, allowed) else None


def _bare_name_hint(arch: str) -> str:
    """' (did you mean torchvision:resnet18?)' for a bare torchvision model name, the same
    with ``transformers:`` for a bare transformers model class name, or ''."""
    import torchvision

    name = arch.strip().strip(":")
    if name in torchvision.models.list_models():
        return f" (did you mean torchvision:{name}?)"
    return f" (did you mean transformers:{name}?)" if is_model_class_name(name) else ""


def _is_allowed(module_path: str, allowed_modules: Sequence[str]) -> bool:
    """Whether ``module_path`` is one of the prefixes or below one, on dotted boundaries."""
    for prefix in parse_allowed_modules(allowed_modules):
        if module_path == prefix or module_path.startswith(prefix + "."):
            return True
    return False


def _module_factory(arch: str, module_path: str, attribute_path: str) -> Callable[..., Any]:
    """The callable ``attribute_path`` of an allowed module, or an error naming what is missing."""
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ArchitectureError(f"cannot import module {module_path!r} for {arch}: {one_line(exc)}") from exc
    except Exception as exc:  # the module's own code failed while importing
        raise ArchitectureError(
            f"importing module {module_path!r} for {arch} failed: {one_line(exc)}"
        ) from exc
    factory: Any = module
    for part in attribute_path.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError as exc:
            names = [n for n in dir(factory) if not n.startswith("_") and callable(getattr(factory, n, None))]
            raise ArchitectureError(
                f"module {module_path!r} has no attribute {attribute_path!r} (arch {arch})"
                f"{_suggestion(part, names)}",
            ) from exc
    if not callable(factory):
        raise ArchitectureError(
            f"{arch} is not callable (it is a {type(factory).__name__}); "
            "it must name a function or class that returns a torch.nn.Module",
        )
    return factory


def check_architecture_exists(arch: str, allowed_modules: Sequence[str] = ()) -> None:
    """Refuse a reference that cannot be built, before a job exists: a malformed or
    disallowed one, an unknown torchvision or timm name, a ``transformers:`` name that is
    not a model class of the package, an allowed module without that callable; errors
    suggest close names. Builds nothing, downloads nothing."""
    source, name = check_architecture(arch, allowed_modules)
    if source == "torchvision":
        _torchvision_builder(name)
    elif source == "timm":
        _timm_module(name)
    elif source == "transformers":
        model_class(name)
    else:
        _module_factory(arch, source, name)


def _build_from_module(
    arch: str,
    module_path: str,
    attribute_path: str,
    kwargs: dict[str, Any],
    allowed_modules: Sequence[str],
) -> torch.nn.Module:
    """Build ``<module.path>:<callable>`` from a module the operator allowed (checked by
    ``check_architecture`` first)."""
    factory = _module_factory(arch, module_path, attribute_path)
    return _call_factory(arch, factory, kwargs, factory)


def _signature_parameters(func: Callable[..., Any]) -> Mapping[str, inspect.Parameter] | None:
    """The parameters of ``func``, or None when Python cannot tell (builtins, C types)."""
    try:
        return inspect.signature(func).parameters
    except (TypeError, ValueError):
        return None


def _call_factory(
    arch: str,
    call: Callable[..., Any],
    kwargs: dict[str, Any],
    signature_of: Callable[..., Any] | None,
) -> torch.nn.Module:
    """Call a model factory, turning rejected kwargs and wrong return types into our errors."""
    if signature_of is not None:
        try:
            inspect.signature(signature_of).bind(**kwargs)
        except TypeError as exc:
            raise SpecError(
                f"model_kwargs do not fit {arch}: {one_line(exc)}", field="model_kwargs"
            ) from exc
        except ValueError:
            pass  # no signature available: let the call decide
    try:
        model = call(**kwargs)
    except TypeError as exc:
        raise SpecError(
            f"model_kwargs do not fit {arch}: {one_line(exc)}", field="model_kwargs"
        ) from exc
    except (ValueError, AssertionError) as exc:
        if kwargs:
            raise SpecError(
                f"{arch} rejected model_kwargs {kwargs!r}: {one_line(exc)}", field="model_kwargs"
            ) from exc
        raise ArchitectureError(f"building {arch} failed: {one_line(exc)}") from exc
    except Exception as exc:
        raise ArchitectureError(f"building {arch} failed: {one_line(exc)}") from exc
    if not isinstance(model, torch.nn.Module):
        raise ArchitectureError(
            f"{arch} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model
