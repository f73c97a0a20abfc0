"""Loading a ``torch.export`` archive without running anything it holds: the archive read
and its graph checked (``archive.py``, ``checks.py``), then torch's own deserializer fed the
checked graph and the tensors decoded by hand."""

from __future__ import annotations

import os
from typing import Any

from bnrecal.errors import ProgramError, one_line

from .archive import ProgramArchive, read_archive
from .checks import checked_graph
from .module import ProgramModule


def load_program(source: str | os.PathLike[str] | bytes, name: str | None = None) -> ProgramModule:
    """The program in a ``.pt2`` archive (a path or its bytes), ready to run, never
    having run anything the file holds. ``name`` is what messages call the file."""
    archive = read_archive(source, name)
    return ProgramModule(_deserialize(archive), archive.name)


def _deserialize(archive: ProgramArchive) -> Any:
    """torch's deserializer, on the checked graph and the tensors decoded by hand."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass

    document = checked_graph(archive.graph, archive.name)
    try:
        serialized = _dict_to_dataclass(schema.ExportedProgram, document)
        return ExportedProgramDeserializer().deserialize(
            serialized, archive.state_dict, archive.constants, archive.example_inputs or ((), {})
        )
    except ProgramError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's deserializer raises many types
        unknown = _unregistered_type(exc)
        if unknown is not None:
            raise ProgramError(
                f"program {archive.name} returns a {unknown}, a type bnrecal cannot rebuild (it would have to "
                "import its code): export the model with outputs of tensors, tuples, lists or dicts (for a "
                "Hugging Face model, config.return_dict=False, or a wrapper returning the logits)"
            ) from exc
        raise ProgramError(
            f"program {archive.name} cannot be deserialized by this torch: {type(exc).__name__}: {one_line(exc)[:300]}"
        ) from exc


def _unregistered_type(exc: BaseException) -> str | None:
    """The output type a program's pytree spec names that this process has not registered
    (a Hugging Face ``ModelOutput``, a dataclass), from torch's deserializer's error."""
    import re

    found = re.search(r"Deserializing ([\w.]+) in pytree is not registered", str(exc))
    return found.group(1) if found else None


def check_program(source: str | os.PathLike[str], name: str | None = None) -> None:
    """Refuse, without loading its tensors, an archive bnrecal would refuse to load: not a
    ``.pt2``, unsafe names, pickled members, a graph naming code or unknown operators.
    Cheap enough for the API process at submission; the rest is checked when a job loads it."""
    archive = read_archive(source, name, decode=False)
    checked_graph(archive.graph, archive.name)
