"""Which key prefix a checkpoint carries, decided against the model's own keys
(docs/models.md, "Checkpoint layouts").

Wrappers put one prefix in front of every key of a state dict: DDP's ``module.``,
``torch.compile``'s ``_orig_mod.``, a Lightning module's attribute (``model.``, ``net.``),
or several at once (``module._orig_mod.``). The keys alone cannot tell a wrapper's prefix
from a model's own first attribute (a model may well have a ``model`` or ``module``
child), so the stored keys are compared with the model's: as stored first, then without
each dotted prefix that every key shares. What ``load_into_model`` tolerates counts as
matching here too: BN ``num_batches_tracked`` buffers that legacy checkpoints lack, and
tied tensors stored under one of their names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from bnrecal.errors import CheckpointError
from bnrecal.workers.models.fit_hints import checkpoint_hint

_LISTED = 5  # how many keys of each kind an error message names


@dataclass(frozen=True)
class ModelKeys:
    """A model's state dict keys, with what a checkpoint may leave out of them."""

    expected: list[str]
    counters: frozenset[str]
    aliases: dict[str, list[str]]


@dataclass(frozen=True)
class KeyMatch:
    """How the stored keys, less ``prefix``, meet the model's keys.

    ``sources`` maps each model key to the stored key (prefix removed) it loads from;
    BN counters that the checkpoint lacks have no entry (the model keeps its own).
    ``tried`` holds the prefixes tried besides none when no attempt fitted.
    """

    prefix: str
    sources: dict[str, str]
    missing: list[str]
    unexpected: list[str]
    tried: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """Whether every model key has a value and every stored key a place."""
        return not self.missing and not self.unexpected

    def error(
        self,
        mismatched: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        model_order: Sequence[str] = (),
    ) -> CheckpointError:
        """The one-line error for these keys and the given shape mismatches (model key ->
        (stored shape, model shape)): what was tried, the missing, unexpected and mismatched
        keys of this attempt, and what to check (``fit_hints``); its ``field`` is that setting."""
        shapes = dict(mismatched or {})
        shown = [f"{key} {stored} vs model {expected}" for key, (stored, expected) in shapes.items()]
        kinds = (("missing", self.missing), ("unexpected", self.unexpected), ("shape mismatches", shown))
        parts = [name_keys(kind, keys) for kind, keys in kinds if keys]
        if self.tried:
            which = f"without {self.prefix!r}" if self.prefix else "as stored"
            tried = _listed(list(self.tried))
            what = f"keys match the architecture neither as stored nor without {tried}; closest {which}"
        else:
            what = "does not match the architecture" + (f" (keys without {self.prefix!r})" if self.prefix else "")
        hint, field = checkpoint_hint(len(self.sources), self.missing, self.unexpected, shapes, model_order)
        error = CheckpointError(f"checkpoint {what}: {'; '.join(parts)}" + (f"; {hint}" if hint else ""))
        error.field = field
        return error


def name_keys(kind: str, keys: list[str]) -> str:
    """'2 missing: a, b' with at most a few names listed, so an error stays one short line."""
    shown = ", ".join(keys[:_LISTED]) + (", ..." if len(keys) > _LISTED else "")
    return f"{len(keys)} {kind}: {shown}"


def model_keys(model: torch.nn.Module) -> ModelKeys:
    """The model's keys, its BN counter keys and its tied-tensor aliases, read once."""
    state = model.state_dict(keep_vars=True)
    counters = {
        f"{name}.num_batches_tracked" if name else "num_batches_tracked"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._NormBase)
    }
    groups: dict[int, list[str]] = {}
    for key, value in state.items():
        groups.setdefault(id(value), []).append(key)
    aliases = {key: [k for k in group if k != key] for group in groups.values() for key in group}
    return ModelKeys(list(state), frozenset(counters), aliases)


def match_keys(model: ModelKeys, stored: Iterable[str], prefix: str) -> KeyMatch:
    """Compare the stored keys, with ``prefix`` removed, to the model's keys.

    The caller makes sure every stored key carries ``prefix``.
    """
    loaded = {key[len(prefix):] for key in stored}
    expected = set(model.expected)
    sources: dict[str, str] = {}
    missing: list[str] = []
    for key in model.expected:
        if key in loaded:
            sources[key] = key
            continue
        present = [alias for alias in model.aliases.get(key, []) if alias in loaded]
        if present:
            sources[key] = present[0]
        elif key not in model.counters:  # a legacy checkpoint keeps the model's counter
            missing.append(key)
    unexpected = [key[len(prefix):] for key in stored if key[len(prefix):] not in expected]
    return KeyMatch(prefix, sources, missing, unexpected)


def shared_prefixes(stored: Iterable[str]) -> list[str]:
    """Every dotted prefix all keys carry, shortest first: ``['model.', 'model.net.']``.

    Each key keeps at least one component, so a prefix never swallows a whole key.
    """
    common: list[str] | None = None
    for key in stored:
        parts = key.split(".")[:-1]
        if common is None:
            common = parts
            continue
        length = 0
        while length < min(len(common), len(parts)) and common[length] == parts[length]:
            length += 1
        common = common[:length]
        if not common:
            break
    return [".".join(common[: n + 1]) + "." for n in range(len(common or []))]


def _listed(prefixes: list[str], last: str = "or") -> str:
    """"'a.' or 'a.b.'" / "'a.', 'a.b.' or 'a.b.c.'" for an error message."""
    quoted = [repr(prefix) for prefix in prefixes]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} {last} {quoted[-1]}"


def choose_prefix(model: ModelKeys, stored: list[str]) -> KeyMatch:
    """How the stored keys meet the model: as stored if they fit, else without the one
    shared prefix whose removal makes them fit, else the closest attempt (``tried`` then
    names the prefixes tried, for :meth:`KeyMatch.error`).

    More than one fitting prefix is a :class:`CheckpointError` naming them: loading
    would have to guess which keys are the model's.
    """
    as_stored = match_keys(model, stored, "")
    if as_stored.fits:
        return as_stored
    candidates = shared_prefixes(stored)
    attempts = [as_stored] + [match_keys(model, stored, prefix) for prefix in candidates]
    fitting = [attempt for attempt in attempts if attempt.fits]
    if len(fitting) == 1:
        return fitting[0]
    if fitting:
        raise CheckpointError(
            f"checkpoint keys match the architecture without {_listed([m.prefix for m in fitting], 'and')} alike "
            f"(tried as stored and without {_listed(candidates)}); "
            "save the state_dict of the bare model so its keys match as stored"
        )
    closest = min(attempts, key=lambda attempt: len(attempt.missing) + len(attempt.unexpected))
    return replace(closest, tried=tuple(candidates))
