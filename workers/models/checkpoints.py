"""Read, load and write checkpoints without ever running code from them (docs/models.md,
"Checkpoint layouts").

A checkpoint is either a safetensors file or a torch file read with
``torch.load(weights_only=True)``. The state dict may be the whole file or sit one level
down under ``state_dict``, ``model``, ``model_state_dict`` or ``module`` (a Lightning
checkpoint's ``state_dict``, beside its epoch, optimizer states and callbacks). Its keys
may carry a wrapper's prefix (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``, a
Lightning module's ``model.``), which :func:`load_into_model` finds by comparing them with
the model's (``workers.models.checkpoint_prefix``). :func:`save_checkpoint` writes the
recalibrated values back in exactly the uploaded format and layout, prefix included,
leaving every other byte of content alone.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bnrecal.errors import CheckpointError, one_line
from bnrecal.workers.files import atomic_write
from bnrecal.workers.models.checkpoint_prefix import choose_prefix, model_keys

STATE_DICT_KEYS = ("state_dict", "model", "model_state_dict", "module")

log = logging.getLogger("bnrecal.checkpoints")


@dataclass
class Checkpoint:
    """A loaded checkpoint: the container as read, and where its state dict sits in it.

    ``prefix`` is what every stored key carries and the model's keys lack: ``''`` as
    read, set by :func:`load_into_model` once the model's keys tell it.
    """

    format: Literal["safetensors", "torch"]
    container: Any
    location: tuple[str, ...]
    prefix: str
    metadata: dict[str, str] | None

    @property
    def stored_state_dict(self) -> Mapping[str, torch.Tensor]:
        """The state dict exactly as stored (keys still carrying the prefix)."""
        found: Any = self.container
        for key in self.location:
            found = found[key]
        return found

    @property
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict with model keys (the prefix stripped)."""
        cut = len(self.prefix)
        return {key[cut:]: value for key, value in self.stored_state_dict.items()}


def load_checkpoint(path: str | os.PathLike[str], name: str | None = None) -> Checkpoint:
    """Read a checkpoint file safely and find its state dict.

    The format is decided by the content, not the file name. Torch files are read with
    the weights-only unpickler, so a file that would need arbitrary code to load is
    refused instead of run. ``name`` is what error messages call the file (default: its
    own name); the service passes the name a blob was uploaded with, since the stored
    file is named after its digest. The key prefix is left for :func:`load_into_model`
    to decide, since only the model's keys tell a wrapper's prefix from a model's own.
    """
    file = Path(path)
    name = repr(name or file.name)
    if file.is_dir():
        raise CheckpointError(f"checkpoint {name} is a directory, not a file")
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            head = handle.read(9)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {name}: {exc.strerror or exc}") from exc
    if size == 0:
        raise CheckpointError(f"checkpoint {name} is empty")
    if _looks_like_safetensors(head, size):
        tensors, metadata = _read_safetensors(file, name)
        checkpoint_format: Literal["safetensors", "torch"] = "safetensors"
        container: Any = tensors
    else:
        container = _read_torch(file, name)
        checkpoint_format, metadata = "torch", None
    location = _find_state_dict(container, name)
    return Checkpoint(checkpoint_format, container, location, "", metadata)


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    """Whether the first bytes are a safetensors header: u64 LE length, then a JSON object."""
    if len(head) < 9:
        return False
    header_length = int.from_bytes(head[:8], "little")
    return 2 <= header_length <= size - 8 and head[8:9] == b"{"


def _read_safetensors(file: Path, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """All tensors of a safetensors file, and its header metadata (``name``: the file as messages quote it)."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            metadata = handle.metadata()
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError
        raise CheckpointError(
            f"checkpoint {name} is a corrupt safetensors file: {one_line(exc)}"
        ) from exc
    return tensors, (dict(metadata) if metadata is not None else None)


def _read_torch(file: Path, name: str, mmap: bool = False) -> Any:
    """The object in a torch file, read with the weights-only unpickler and nothing else.

    A file torch cannot even parse (cut short, or not a torch file at all) gets one plain
    sentence; torch's own words (miniz's paragraph about a corrupt zip, an EOF, a
    ``KeyError`` from the unpickler) stay in the log and the exception chain. ``mmap``
    maps the tensor data instead of reading it (to learn shapes without loading).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        detail = str(exc.__context__ or exc.__cause__ or exc)
        if "Weights only load failed" not in str(exc):
            raise _unreadable(name, exc) from exc
        match = re.search(r"GLOBAL ([\w.]+)", detail)
        if match:
            raise CheckpointError(
                f"checkpoint {name} needs a full unpickle (it references {match.group(1)}); "
                "bnrecal only loads weights: save a state_dict with torch.save or use safetensors"
            ) from None
        reason = one_line(exc.__context__ or exc)
        raise CheckpointError(
            f"checkpoint {name} cannot be read as weights only ({reason}); "
            "it is corrupt or needs a full unpickle, which bnrecal never does"
        ) from None
    except Exception as exc:  # zip errors, EOF, bad magic number, truncated storages
        raise _unreadable(name, exc) from exc


def _unreadable(name: str, exc: BaseException) -> CheckpointError:
    """The error for a file torch cannot parse; what torch said goes to the log only."""
    log.info("checkpoint %s: torch.load failed: %s: %s", name, type(exc).__name__, exc)
    return CheckpointError(f"checkpoint {name} is truncated or not a torch/safetensors file")


def _is_tensor_dict(value: Any) -> bool:
    """Whether ``value`` is a non-empty dict mapping string keys to tensors."""
    return (
        isinstance(value, Mapping)
        and len(value) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def _find_state_dict(container: Any, name: str) -> tuple[str, ...]:
    """Keys leading from the container to its state dict, () when it is one."""
    if _is_tensor_dict(container):
        return ()
    if isinstance(container, Mapping):
        for key in STATE_DICT_KEYS:
            if key in container and _is_tensor_dict(container[key]):
                return (key,)
        found = ", ".join(repr(k) for k in list(container)[:8]) or "nothing"
        raise CheckpointError(
            f"checkpoint {name} holds no state dict: expected a dict of tensors, or one under "
            f"{', '.join(STATE_DICT_KEYS)}; found keys {found}"
        )
    raise CheckpointError(
        f"checkpoint {name} holds a {type(container).__name__}, not a state dict"
    )


def _strip_metadata(stored: Any, prefix: str) -> dict[str, Any] | None:
    """The torch ``_metadata`` (module versions) of a state dict, with the prefix removed."""
    metadata = getattr(stored, "_metadata", None)
    if not isinstance(metadata, Mapping):
        return None
    if not prefix:
        return dict(metadata)
    stripped: dict[str, Any] = {}
    for key, value in metadata.items():
        if key == prefix.rstrip("."):
            stripped[""] = value
        elif key.startswith(prefix):
            stripped[key[len(prefix):]] = value
    return stripped


def load_into_model(model: torch.nn.Module, checkpoint: Checkpoint) -> None:
    """Copy the checkpoint's weights into ``model``, strictly, and settle its key prefix.

    The keys are taken as stored when they match the model's, else without the one
    prefix every key carries whose removal makes them match (``checkpoint.prefix`` is
    set to it, so :func:`save_checkpoint` writes it back). Missing or unexpected keys,
    and shape mismatches, are one error that names them. Legacy BN checkpoints without
    ``num_batches_tracked`` and checkpoints that store a tied tensor once are accepted.
    Values are converted to the model's dtype (fp16/bf16 checkpoints load into a float32
    model).
    """
    stored = checkpoint.stored_state_dict
    match = choose_prefix(model_keys(model), list(stored))
    expected = model.state_dict()
    to_load = {
        key: stored[match.prefix + match.sources[key]] if key in match.sources else target.clone()
        for key, target in expected.items()
    }
    mismatched = {
        key: (tuple(to_load[key].shape), tuple(expected[key].shape))
        for key in match.sources
        if to_load[key].shape != expected[key].shape
    }
    if not match.fits or mismatched:
        raise match.error(mismatched, list(expected))
    ordered: Any = dict(to_load)
    metadata = _strip_metadata(stored, match.prefix)
    if metadata is not None:
        ordered = _with_metadata(to_load, metadata)
    try:
        model.load_state_dict(ordered, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(
            f"checkpoint does not load into the architecture: {one_line(exc)}"
        ) from exc
    checkpoint.prefix = match.prefix  # save_checkpoint writes it back


def _with_metadata(values: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Any:
    """An OrderedDict of ``values`` carrying torch's ``_metadata`` attribute."""
    from collections import OrderedDict

    result: Any = OrderedDict(values)
    result._metadata = OrderedDict(metadata)
    return result


def save_checkpoint(
    checkpoint: Checkpoint, updates: Mapping[str, torch.Tensor], path: str | os.PathLike[str]
) -> None:
    """Write ``checkpoint`` to ``path`` with the tensors named in ``updates`` replaced.

    Keys in ``updates`` are model keys; each value is cast to the stored tensor's dtype
    and must have its shape. Keys the checkpoint does not hold are skipped, never added.
    Everything else (other tensors, nested entries, prefix, safetensors metadata) is
    written back unchanged. The file appears atomically.
    """
    stored = checkpoint.stored_state_dict
    new_state = copy.copy(stored)  # same type, key order and torch _metadata
    for model_key, value in updates.items():
        key = checkpoint.prefix + model_key
        if key not in stored:
            continue
        old = stored[key]
        if tuple(value.shape) != tuple(old.shape):
            raise CheckpointError(
                f"update for {model_key} has shape {tuple(value.shape)}, "
                f"the checkpoint stores {tuple(old.shape)}"
            )
        new_state[key] = value.detach().to(device="cpu", dtype=old.dtype).contiguous().clone()
    container = _replace_at(checkpoint.container, checkpoint.location, new_state)
    target = Path(path)
    if checkpoint.format == "safetensors":
        atomic_write(target, lambda tmp: _save_safetensors(container, checkpoint.metadata, tmp))
    else:
        atomic_write(target, lambda tmp: _torch_save(container, tmp))


def _replace_at(container: Any, location: tuple[str, ...], value: Any) -> Any:
    """A shallow copy of ``container`` with the entry at ``location`` set to ``value``."""
    if not location:
        return value
    outer = copy.copy(container)
    outer[location[0]] = _replace_at(container[location[0]], location[1:], value)
    return outer


def _save_safetensors(
    tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None, tmp: Path
) -> None:
    """Save tensors to safetensors, unsharing any that share memory (the format forbids it)."""
    seen_storages: set[int] = set()
    unshared: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        if tensor.numel() and (storage in seen_storages or not tensor.is_contiguous()):
            tensor = tensor.contiguous().clone()
            storage = tensor.untyped_storage().data_ptr()
        seen_storages.add(storage)
        unshared[key] = tensor
    save_file(unshared, str(tmp), metadata=metadata)


def _torch_save(container: Any, path: Path) -> None:
    """torch.save through a file object: the zip records are then named ``archive/``, not
    after our temporary file, so the same content always gives the same bytes."""
    with path.open("wb") as handle:
        torch.save(container, handle)
