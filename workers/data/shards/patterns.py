"""Globs (``train-*.parquet``) are not expanded: shards are named by a brace pattern, which
names every one of them and only plain names in its last path component (docs/data.md,
"WebDataset"). A data path that names nothing because it is a glob says so, and gives the
brace pattern that names the same shards where one does.
"""

from __future__ import annotations

import glob
import os
import re

from bnrecal.errors import DatasetError
from bnrecal.workers.data.storage.objectstore import RemoteSource, stat_object
from bnrecal.workers.data.storage.files import is_shard_name
from bnrecal.workers.data.shards.listing import expand_braces

_GLOB = re.compile(r"[*?\[]")
_LIST_LIMIT = 20
BRACE_EXAMPLE = "train-{000000..000146}.tar"
"""The brace pattern messages show when there are no files to make one from."""


def is_glob(value: str) -> bool:
    """Whether a path or URI holds a glob's wildcards (``*``, ``?``, ``[``)."""
    return bool(_GLOB.search(value))


def not_found(path: str, role: str) -> DatasetError:
    """The error of a local data path that names nothing, with :func:`glob_hint`'s advice."""
    hint = glob_hint(path)
    return DatasetError(f"{role} not found: {path}" + (f"; {hint}" if hint else ""))


def stat_data(remote: RemoteSource, role: str) -> tuple[str, int]:
    """:func:`workers.data.storage.objectstore.stat_object`; a glob that names no object fails with
    :func:`glob_hint`'s advice (its matches are not listed)."""
    try:
        return stat_object(remote, role)
    except DatasetError as exc:
        hint = glob_hint(remote.uri, local=False)
        if not hint:
            raise
        raise DatasetError(f"{exc.message}; {hint}") from exc


def glob_hint(value: str, *, local: bool = True) -> str:
    """What to write instead of a glob that names no file, '' when ``value`` is no glob: that
    globs are not expanded, and (local files) the brace pattern of its matches where one names
    them all, else their folder; without matches, the brace pattern syntax."""
    if not is_glob(value):
        return ""
    said = "globs (*, ?, [...]) are not expanded"
    files = sorted(p for p in glob.glob(os.path.expanduser(value)) if os.path.isfile(p)) if local else []
    if len(files) == 1:
        return f"{said}: give its one match, {files[0]}"
    pattern = brace_pattern(files)
    if pattern is not None:
        return f"{said}: give its {len(files)} matches as the brace pattern '{pattern}'"
    if files:
        folders = sorted({os.path.dirname(p) or "." for p in files})
        return f"{said}: give the folder its {len(files)} matches lie in ({', '.join(folders)})"
    syntax = f"a brace pattern such as '{BRACE_EXAMPLE}' ({{000..146}} ranges keep the zero padding, {{a,b}} lists)"
    if not local:
        return f"{said}: name the shards with {syntax}, or give their prefix"
    return f"{said}, and it matches no file either: name shards with {syntax}"


def brace_pattern(paths: list[str]) -> str | None:
    """The brace pattern (``train-{00000..00002}.parquet``, or a ``{a,b}`` list of a few)
    that expands to exactly ``paths`` (shards of one folder), or None when none does."""
    folders = {os.path.dirname(p) for p in paths}
    names = sorted(os.path.basename(p) for p in paths)
    if len(paths) < 2 or len(folders) != 1 or not all(is_shard_name(n) for n in names):
        return None
    folder = folders.pop()
    for numbered in (True, False):
        body = _varying(names, numbered)
        if body is None:
            continue
        pattern = os.path.join(folder, body)
        try:
            if expand_braces(pattern) == sorted(paths):
                return pattern
        except DatasetError:
            pass
    return None


def _varying(names: list[str], numbered: bool) -> str | None:
    """``names`` as one name with braces where they differ: a range of the number that varies
    (``numbered``), else a list of the words that do."""
    prefix = os.path.commonprefix(names)
    suffix = os.path.commonprefix([n[len(prefix):][::-1] for n in names])[::-1]
    part = str.isdigit if numbered else str.isalnum
    while prefix and part(prefix[-1]):  # a number (a word) varies whole: 00009, 00010
        prefix = prefix[:-1]
    while suffix and part(suffix[0]):
        suffix = suffix[1:]
    middles = [n[len(prefix): len(n) - len(suffix)] for n in names]
    if not all(middles):
        return None
    if numbered:
        if not all(m.isdigit() for m in middles):
            return None
        numbers = sorted(middles, key=int)
        return f"{prefix}{{{numbers[0]}..{numbers[-1]}}}{suffix}"
    return f"{prefix}{{{','.join(middles)}}}{suffix}" if len(middles) <= _LIST_LIMIT else None
