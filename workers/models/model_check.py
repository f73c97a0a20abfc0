"""Does a checkpoint fit its architecture? Told without materialising either.

A job spec names an architecture, its ``model_kwargs`` and a checkpoint. Building the
model to compare it with the checkpoint would allocate whatever the kwargs say in the
process that checks (``num_classes`` 3,000,000 makes a resnet18 of 6 GB), so the check
builds the model on torch's ``meta`` device (shapes, no memory) and reads only the
checkpoint's tensor shapes (the safetensors header; a torch file through a memory map
whose data pages are never read). It refuses a model larger than a set bound, and any
key or shape the checkpoint does not match, with the errors loading would give.

A few architectures compute their configuration from tensors while they are built
(torchvision's RegNet), which the meta device cannot do. Those are built for real in a
child process that is killed when it outgrows the bound, so the checking process still
allocates nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from bnrecal.errors import ArchitectureError, CheckpointError, ModelInputError, SpecError
from bnrecal.workers.models.architectures import build_model, check_architecture_exists
from bnrecal.workers.models.checkpoint_prefix import ModelKeys, choose_prefix, model_keys
from bnrecal.workers.models.checkpoints import STATE_DICT_KEYS, _looks_like_safetensors, _read_torch
from bnrecal.workers.suggestions import sample_shape_hint

CHILD_TIMEOUT_S = 120.0
"""Longest a child process may take to build an architecture the meta device cannot."""


def checkpoint_shapes(path: str | os.PathLike[str], name: str | None = None) -> dict[str, tuple[int, ...]]:
    """The state dict's keys and shapes as stored (prefix included), read without loading
    tensor data (except from a legacy torch file, which cannot be mapped); the errors are
    those of loading it."""
    file = Path(path)
    shown = repr(name or file.name)
    with file.open("rb") as handle:
        head = handle.read(9)
    if _looks_like_safetensors(head, file.stat().st_size):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"checkpoint {shown} is a corrupt safetensors file: {exc}") from exc
    # torch's zip format maps its tensor data; a legacy (pre-1.6) file or a plain pickle cannot
    # be mapped and is read as loading would read it, weights only (bounded by the upload cap).
    container = _read_torch(file, shown, mmap=head[:2] == b"PK")
    if isinstance(container, Mapping):
        for key in STATE_DICT_KEYS:
            if isinstance(container.get(key), Mapping):
                container = container[key]
                break
    if not isinstance(container, Mapping):
        raise CheckpointError(f"checkpoint {shown} holds a {type(container).__name__}, not a state dict")
    return {key: tuple(value.shape) for key, value in container.items() if isinstance(value, torch.Tensor)}


def model_layout(
    arch: str, model_kwargs: Mapping[str, Any], allowed_modules: Sequence[str], max_bytes: int
) -> tuple[ModelKeys, dict[str, tuple[int, ...]]]:
    """The architecture's state dict keys and shapes, built on the meta device (or, where
    that cannot work, in a bounded child process); refuses a model over ``max_bytes``."""
    check_architecture_exists(arch, allowed_modules)  # an unknown or disallowed name needs no build, nor a child
    try:
        with torch.device("meta"):
            model = build_model(arch, model_kwargs, allowed_modules=allowed_modules, device="meta")
    except (ArchitectureError, SpecError) as exc:
        if not _needs_real_tensors(exc):
            raise
        return _layout_in_child(arch, model_kwargs, allowed_modules, max_bytes)
    state = model.state_dict(keep_vars=True)
    _check_size(arch, _nbytes(state), max_bytes)
    return model_keys(model), {key: tuple(value.shape) for key, value in state.items()}


def check_checkpoint_fits(
    arch: str,
    model_kwargs: Mapping[str, Any],
    checkpoint: str | os.PathLike[str],
    *,
    allowed_modules: Sequence[str] = (),
    max_bytes: int,
    name: str | None = None,
) -> None:
    """Refuse, as loading would, a checkpoint whose keys or shapes do not match the
    architecture; and refuse a model over ``max_bytes`` (``BNRECAL_MAX_MODEL_BYTES``)."""
    keys, expected = model_layout(arch, model_kwargs, allowed_modules, max_bytes)
    stored = checkpoint_shapes(checkpoint, name)
    match = choose_prefix(keys, list(stored))
    mismatched = {
        key: (stored[match.prefix + source], expected[key])
        for key, source in match.sources.items()
        if stored[match.prefix + source] != expected[key]
    }
    if not match.fits or mismatched:
        raise match.error(mismatched, keys.expected)


def check_data_fits(
    arch: str,
    model_kwargs: Mapping[str, Any],
    sample_shape: Sequence[int] | None,
    *,
    allowed_modules: Sequence[str] = (),
    field: str = "data",
    name: str | None = None,
) -> None:
    """Refuse, before a job exists, data whose samples the model rejects, when the layer
    that takes the input tells why (channels-last, the wrong channel count): one forward on
    the meta device, so nothing is computed or allocated. A model that cannot run on the
    meta device, a rejection with no clear cause, or data other than arrays is left to the
    job's own probe (``sample_shape`` None: not known before reading, e.g. images)."""
    if sample_shape is None:
        return
    try:
        with torch.device("meta"):
            model = build_model(arch, model_kwargs, allowed_modules=allowed_modules, device="meta")
    except Exception:  # noqa: BLE001 - the architecture checks report their own problems
        return
    shape = tuple(int(size) for size in sample_shape)
    try:
        with torch.inference_mode():
            model.eval()(torch.empty((2, *shape), device="meta"))
    except Exception:  # noqa: BLE001 - whatever the model raised, the hint below says why or nothing
        hint = sample_shape_hint(model, shape)
        if hint:
            shown = f" {name!r}" if name else ""
            error = ModelInputError(f"{field}{shown}: the model rejects samples of shape {shape}: {hint}")
            error.field = field
            raise error from None


def _nbytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a state dict's distinct tensors (a tied tensor counts once)."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())


def _check_size(arch: str, size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise SpecError(
            f"model_kwargs: {arch} with these arguments has {size / 2**30:.1f} GiB of weights, over this "
            f"server's limit of {max_bytes / 2**30:.1f} GiB (BNRECAL_MAX_MODEL_BYTES)",
            field="model_kwargs",
        )


def _needs_real_tensors(exc: Exception) -> bool:
    """Whether a meta build's failure may be the meta device's (anything but arguments the
    factory's signature refuses): the bounded child then builds it for real, and says."""
    return not (isinstance(exc, SpecError) and "do not fit" in str(exc))


def _layout_in_child(
    arch: str, model_kwargs: Mapping[str, Any], allowed_modules: Sequence[str], max_bytes: int
) -> tuple[ModelKeys, dict[str, tuple[int, ...]]]:
    """Build the model for real in a child process, killed once its memory passes the bound."""
    request = json.dumps({"arch": arch, "kwargs": dict(model_kwargs), "allowed": list(allowed_modules)})
    child = subprocess.Popen(
        [sys.executable, "-m", "bnrecal.workers.models.model_check"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    outgrown = threading.Event()
    baseline = 3 * 2**30  # the interpreter with torch and the model libraries imported
    watcher = threading.Thread(target=_watch, args=(child, baseline + max_bytes, outgrown), daemon=True)
    watcher.start()
    try:
        out, err = child.communicate(request, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise ArchitectureError(f"building {arch} to check it took over {CHILD_TIMEOUT_S:g} s") from None
    if outgrown.is_set():
        _check_size(arch, max_bytes + 1, max_bytes)
    if child.returncode != 0 and "can't allocate memory" in err:
        _check_size(arch, max_bytes + 1, max_bytes)
    if child.returncode != 0:
        raise ArchitectureError(f"building {arch} failed: {err.strip().splitlines()[-1] if err.strip() else child.returncode}")
    answer = json.loads(out)
    if "error" in answer:
        raise {"ArchitectureError": ArchitectureError, "SpecError": SpecError}.get(answer["kind"], ArchitectureError)(
            answer["error"]
        )
    _check_size(arch, answer["bytes"], max_bytes)
    keys = ModelKeys(answer["expected"], frozenset(answer["counters"]), answer["aliases"])
    return keys, {key: tuple(shape) for key, shape in answer["shapes"].items()}


def _watch(child: subprocess.Popen[str], limit: int, outgrown: threading.Event) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    while child.poll() is None:
        try:
            with open(f"/proc/{child.pid}/statm") as statm:
                resident = int(statm.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            return
        if resident > limit:
            outgrown.set()
            child.kill()
            return
        time.sleep(0.02)


def _child_main() -> None:
    """In the child: build the requested architecture on the CPU, print its shapes and size."""
    request = json.loads(sys.stdin.read())
    try:
        model = build_model(request["arch"], request["kwargs"], allowed_modules=tuple(request["allowed"]))
    except (ArchitectureError, SpecError) as exc:
        if "can't allocate memory" in str(exc):
            raise
        print(json.dumps({"error": str(exc), "kind": type(exc).__name__}))
        return
    state = model.state_dict(keep_vars=True)
    keys = model_keys(model)
    print(json.dumps({
        "shapes": {key: list(value.shape) for key, value in state.items()},
        "bytes": _nbytes(state),
        "expected": keys.expected, "counters": sorted(keys.counters), "aliases": keys.aliases,
    }))


if __name__ == "__main__":
    _child_main()
