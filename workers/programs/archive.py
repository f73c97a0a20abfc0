"""Reading and writing ``.pt2`` archives (``torch.export.save``) without running code.

``torch.export.load`` is not safe on uploads: where its weights-only load of an archive
member fails it retries with a full unpickle, custom objects are unpickled by design,
the graph's symbolic expressions go through ``sympy.sympify`` (an ``eval``) and its
guards are ``exec``'d. So bnrecal reads the archive itself: the zip's names are checked,
tensors are decoded from their raw bytes (an archive member stored as a pickle is
refused), the sample inputs member may only be a weights-only torch file, and the graph
is checked and stripped (``checks.py``) before torch's deserializer builds the program
from it.

A recalibrated program is written by copying the archive member by member and patching
only the bytes of the running buffers: every other tensor stays byte-identical.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from bnrecal.errors import ProgramError, one_line
from ..files import atomic_write

MAX_MEMBERS = 200_000
MAX_EXPANSION = 200
"""A compressed member may expand at most this many times (weights are stored, not deflated)."""
MAX_JSON_BYTES = 128 * 2**20
"""The largest graph document read (a vision model's is a few MB)."""
MAX_SAMPLE_INPUTS_BYTES = 64 * 2**20
"""The largest sample-inputs member read (one example batch; it is loaded, and checked at submission)."""

_WEIGHTS = "data/weights/"
_CONSTANTS = "data/constants/"
_TENSOR_CONSTANT = "tensor_"


@dataclass
class ProgramArchive:
    """A ``.pt2`` archive's parts, read safely: the graph as JSON, tensors by name."""

    name: str
    root: str
    model: str
    graph: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    constants: dict[str, torch.Tensor]
    example_inputs: tuple[tuple[Any, ...], dict[str, Any]] | None
    weights_config: dict[str, Any] = field(repr=False, default_factory=dict)


def read_archive(
    source: str | os.PathLike[str] | bytes, name: str | None = None, *, decode: bool = True
) -> ProgramArchive:
    """The parts of a ``.pt2`` archive (a path or its bytes), decoded without unpickling.

    Raises ``ProgramError`` naming the archive (``name``, default the file's name) for
    anything that is not a valid, safe ``torch.export`` archive of one program. With
    ``decode=False`` the tensors are checked but not read (a cheap check at submission).
    """
    label = repr(name or (Path(source).name if not isinstance(source, bytes) else "program"))
    try:
        with _open_zip(source, label) as archive:
            root, members = _members(archive, label)
            read = _Reader(archive, root, members, label)
            if read.text("archive_format", limit=64).strip() != "pt2":
                raise ProgramError(f"program {label} is not a torch.export archive (archive_format is not 'pt2')")
            model = _model_name(members, label)
            graph = read.json(f"models/{model}.json")
            weights_config = read.json(f"{_WEIGHTS}{model}_weights_config.json", missing={"config": {}})
            constants_config = read.json(f"{_CONSTANTS}{model}_constants_config.json", missing={"config": {}})
            state_dict = _tensors(read, weights_config, _WEIGHTS, "weight", label, decode)
            constants = _tensors(read, constants_config, _CONSTANTS, "constant", label, decode)
            example_inputs = _example_inputs(read, f"data/sample_inputs/{model}.pt", label)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, KeyError, OSError) as exc:
        if isinstance(exc, ProgramError):
            raise
        raise ProgramError(f"program {label} cannot be read: {one_line(exc)} (a truncated or damaged archive?)") from exc
    return ProgramArchive(
        name=label, root=root, model=model, graph=graph, state_dict=state_dict, constants=constants,
        example_inputs=example_inputs, weights_config=weights_config,
    )


def _open_zip(source: str | os.PathLike[str] | bytes, label: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source)
    except FileNotFoundError as exc:
        raise ProgramError(f"program {label} does not exist") from exc
    except IsADirectoryError as exc:
        raise ProgramError(f"program {label} is a directory, not a .pt2 file") from exc
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise ProgramError(
            f"program {label} is not a .pt2 archive (not a zip file, or cut short); save it with torch.export.save"
        ) from exc


def _members(archive: zipfile.ZipFile, label: str) -> tuple[str, dict[str, zipfile.ZipInfo]]:
    """The archive's root folder and its members by name below it; unsafe names are refused."""
    infos = archive.infolist()
    if not infos:
        raise ProgramError(f"program {label} is an empty zip file, not a torch.export archive")
    if len(infos) > MAX_MEMBERS:
        raise ProgramError(f"program {label} has {len(infos)} members (at most {MAX_MEMBERS})")
    roots = set()
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        path = PurePosixPath(info.filename)
        if (
            info.filename.startswith("/") or "\\" in info.filename or "\x00" in info.filename
            or any(part in ("..", "") for part in info.filename.rstrip("/").split("/"))
        ):
            raise ProgramError(f"program {label} holds an unsafe member name {info.filename[:200]!r}")
        if info.compress_type != zipfile.ZIP_STORED and info.file_size > MAX_EXPANSION * max(info.compress_size, 1) + 2**20:
            raise ProgramError(f"program {label}: member {info.filename[:200]!r} expands {info.file_size} bytes (a zip bomb?)")
        roots.add(path.parts[0])
        if len(path.parts) > 1:
            members["/".join(path.parts[1:])] = info
    if len(roots) != 1:
        raise ProgramError(f"program {label} is not a torch.export archive (its members are not under one folder)")
    return roots.pop(), members


def _model_name(members: Mapping[str, zipfile.ZipInfo], label: str) -> str:
    models = [name[len("models/") : -len(".json")] for name in members if name.startswith("models/") and name.endswith(".json")]
    if not models:
        raise ProgramError(f"program {label} holds no exported program (no models/*.json); save it with torch.export.save")
    if len(models) > 1:
        raise ProgramError(f"program {label} holds {len(models)} programs ({', '.join(sorted(models)[:5])}); upload one")
    return models[0]


class _Reader:
    """Reads members below the archive's root, with size limits and clear errors."""

    def __init__(self, archive: zipfile.ZipFile, root: str, members: dict[str, zipfile.ZipInfo], label: str) -> None:
        self.archive, self.root, self.members, self.label = archive, root, members, label

    def bytes(self, name: str, limit: int | None = None) -> bytes:
        info = self.members.get(name)
        if info is None:
            raise ProgramError(f"program {self.label} has no member {name!r} (a damaged or foreign archive?)")
        if limit is not None and info.file_size > limit:
            raise ProgramError(f"program {self.label}: member {name!r} is {info.file_size} bytes (at most {limit})")
        return self.archive.read(info)

    def text(self, name: str, limit: int) -> str:
        try:
            return self.bytes(name, limit).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProgramError(f"program {self.label}: member {name!r} is not text") from exc

    def json(self, name: str, missing: Any = None) -> Any:
        if missing is not None and name not in self.members:
            return missing
        try:
            return json.loads(self.text(name, MAX_JSON_BYTES))
        except json.JSONDecodeError as exc:
            raise ProgramError(f"program {self.label}: member {name!r} is not valid JSON ({exc.msg})") from exc


def _tensors(read: _Reader, config: Any, folder: str, kind: str, label: str, decode: bool) -> dict[str, torch.Tensor]:
    """Every tensor a payload config lists, decoded from its raw bytes (never unpickled)."""
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise ProgramError(f"program {label}: its {kind} list is malformed")
    storages: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for fqn, meta in entries.items():
        if not isinstance(meta, dict) or not isinstance(meta.get("path_name"), str):
            raise ProgramError(f"program {label}: {kind} {fqn!r} is malformed")
        path = meta["path_name"]
        if meta.get("use_pickle") or (kind == "constant" and not path.startswith(_TENSOR_CONSTANT)):
            raise ProgramError(
                f"program {label}: {kind} {fqn!r} is stored as a pickled object ({path}), which only loads by "
                "running code; bnrecal loads plain tensors only (export a model whose state is tensors)"
            )
        tensor_meta = meta.get("tensor_meta")
        if not isinstance(tensor_meta, dict):
            raise ProgramError(f"program {label}: {kind} {fqn!r} has no tensor description")
        if not decode:
            if folder + path not in read.members:
                raise ProgramError(f"program {label} has no member {folder + path!r} for {kind} {fqn!r}")
            continue
        if path not in storages:
            storages[path] = _storage(read, folder + path, tensor_meta, label)
        tensor = _view(storages[path], tensor_meta, f"{kind} {fqn!r}", label)
        tensors[fqn] = torch.nn.Parameter(tensor, requires_grad=False) if meta.get("is_param") else tensor
    return tensors


def tensor_dtype(code: Any, what: str, label: str) -> torch.dtype:
    """The torch dtype of a serialized scalar-type code."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    try:
        return _SERIALIZE_TO_TORCH_DTYPE[schema.ScalarType(int(code))]
    except (KeyError, ValueError, TypeError) as exc:
        raise ProgramError(f"program {label}: {what} has an unknown dtype code {code!r}") from exc


def _ints(values: Any, what: str, label: str) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(v, dict) and isinstance(v.get("as_int"), int) for v in values):
        raise ProgramError(f"program {label}: {what} has a symbolic or malformed shape")
    return [v["as_int"] for v in values]


def _storage(read: _Reader, member: str, tensor_meta: dict[str, Any], label: str) -> torch.Tensor:
    """A member's raw bytes as a flat tensor of the dtype that uses them."""
    dtype = tensor_dtype(tensor_meta.get("dtype"), member, label)
    data = bytearray(read.bytes(member))
    size = torch.empty((), dtype=dtype).element_size()
    if len(data) % size:
        raise ProgramError(f"program {label}: member {member!r} is not a whole number of {dtype} values")
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype)


def _view(storage: torch.Tensor, tensor_meta: dict[str, Any], what: str, label: str) -> torch.Tensor:
    """The tensor a payload's metadata describes in its storage, bounds checked."""
    if tensor_meta.get("layout", 7) != 7:
        raise ProgramError(f"program {label}: {what} is not a dense (strided) tensor")
    sizes = _ints(tensor_meta.get("sizes"), what, label)
    strides = _ints(tensor_meta.get("strides"), what, label)
    offset_meta = tensor_meta.get("storage_offset", {"as_int": 0})
    offset = offset_meta.get("as_int") if isinstance(offset_meta, dict) else None
    dtype = tensor_dtype(tensor_meta.get("dtype"), what, label)
    if storage.dtype != dtype:
        storage = storage.view(dtype) if storage.numel() else torch.empty(0, dtype=dtype)
    if len(sizes) != len(strides) or not isinstance(offset, int) or offset < 0:
        raise ProgramError(f"program {label}: {what} has a malformed shape")
    if any(s < 0 for s in sizes) or any(s < 0 for s in strides):
        raise ProgramError(f"program {label}: {what} has a negative size or stride")
    if 0 in sizes:
        return torch.empty(sizes, dtype=dtype)
    last = offset + sum((size - 1) * stride for size, stride in zip(sizes, strides))
    if last >= storage.numel():
        if storage.numel() == 0:  # saved without bytes (an empty or meta tensor): zeros, as torch loads it
            return torch.zeros(sizes, dtype=dtype)
        raise ProgramError(f"program {label}: {what} reaches past the end of its bytes (a damaged archive?)")
    return storage.as_strided(sizes, strides, offset)


def _example_inputs(read: _Reader, member: str, label: str) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The archive's sample inputs, loaded weights-only (a pickle that needs more is refused)."""
    if member not in read.members:
        return None
    data = read.bytes(member, MAX_SAMPLE_INPUTS_BYTES)
    if not data:
        return None
    try:
        loaded = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - the weights-only unpickler's refusal, or a damaged file
        raise ProgramError(
            f"program {label}: its sample inputs are not a weights-only torch file (it would need a full unpickle, "
            f"which could run code): {one_line(exc)[:200]}"
        ) from None
    if not (isinstance(loaded, tuple) and len(loaded) == 2 and isinstance(loaded[0], tuple) and isinstance(loaded[1], dict)):
        raise ProgramError(f"program {label}: its sample inputs are not (args, kwargs)")
    return loaded


def write_archive(
    source: str | os.PathLike[str] | bytes,
    updates: Mapping[str, torch.Tensor],
    target: str | os.PathLike[str],
) -> None:
    """Write ``source`` to ``target`` with the tensors named in ``updates`` (state-dict
    names, e.g. ``bn1.running_mean``) replaced; every other member is copied byte for byte.

    Each update must keep its tensor's shape and dtype; the archive is written atomically.
    """
    archive = read_archive(source, decode=False)  # checked again; only the bytes to patch are read
    config = archive.weights_config["config"]
    patched: dict[str, bytearray] = {}
    with _open_zip(source, archive.name) as zin:
        for fqn, value in updates.items():
            meta = config.get(fqn)
            if meta is None:
                raise ProgramError(f"program {archive.name} has no tensor {fqn!r} to update")
            member = f"{archive.root}/{_WEIGHTS}{meta['path_name']}"
            if member not in patched:
                patched[member] = bytearray(zin.read(member))
            tensor_meta = meta["tensor_meta"]
            dtype = tensor_dtype(tensor_meta["dtype"], fqn, archive.name)
            storage = torch.frombuffer(patched[member], dtype=dtype)
            view = _view(storage, tensor_meta, fqn, archive.name)
            if tuple(view.shape) != tuple(value.shape):
                raise ProgramError(f"update of {fqn!r} has shape {tuple(value.shape)}, the program {tuple(view.shape)}")
            view.copy_(value.detach().to(device="cpu", dtype=dtype))

        def write(temp: Path) -> None:
            with zipfile.ZipFile(temp, "w") as zout:
                for info in zin.infolist():
                    data = patched.get(info.filename)
                    zout.writestr(info, bytes(data) if data is not None else zin.read(info))

        out = Path(target)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, write)
