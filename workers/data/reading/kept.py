"""Read once per job: what a rank keeps of the samples it decoded (docs/data.md, "Read once
per job").

A job's passes (the statistics, the evaluation, the INT8 range passes, the INT8 scores)
read the same samples several times. The run stamps each of its datasets with a
:class:`KeepDecoded` (the run's scope, the dataset's name in it, the budgets); a rank that
opens such a dataset for a pass (:func:`open_kept`) reads it through :class:`KeptData`:
a sample it decoded in an earlier pass of the scope comes back from memory, up to
``memory_bytes`` per rank, or beyond that from a spill file on the rank's local disk, up
to ``disk_bytes``; past both it is decoded again when read again. What is kept is the
form ``load_kept`` gives (uint8 crops for images, a quarter of the float32 bytes), and
``from_kept`` makes it the floats ``load`` gives, bit for bit, so a pass reads the same
values whether a sample was kept or not. Data that costs no decode (arrays read from a
memory map) is not kept.

The store is one per process. A rank actor keeps one scope at a time (a new scope drops
the old: a warm rank carries nothing into the next job); the driver's process keeps one
per open run. :func:`release_kept` drops a scope and says what it did (:class:`KeptCounts`,
the report's ``decoding``). A spill that fails (a full disk) keeps nothing more; it never
fails the pass.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from bnrecal.workers.data.opened import CalibrationData


@dataclass(frozen=True)
class KeepDecoded:
    """How a run's ranks keep the samples of one of its datasets: the run's ``scope``, the
    dataset's ``name`` within it (``calibration``, ``evaluation``), and each rank's budgets
    in bytes: memory first, then local disk."""

    scope: str
    name: str
    memory_bytes: int
    disk_bytes: int
    spill_root: str | None = None  # the folder spill files go in (None: the rank's temporary folder)


@dataclass(frozen=True)
class KeptCounts:
    """What the ranks did with a scope's samples: ``decoded`` (each decode of a sample),
    ``reused`` (reads served from what was kept), the bytes kept in memory and spilled to
    disk, and ``not_kept`` (samples neither budget had room for)."""

    decoded: int = 0
    reused: int = 0
    memory_bytes: int = 0
    disk_bytes: int = 0
    not_kept: int = 0

    def __add__(self, other: KeptCounts) -> KeptCounts:
        return KeptCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class _OnDisk:
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


class _Scope:
    """One scope's kept samples: blocks in memory or in the spill file, and where each sample lies."""

    def __init__(self, keep: KeepDecoded) -> None:
        self.keep = keep
        self.blocks: list[torch.Tensor | _OnDisk] = []
        self.where: dict[str, dict[int, tuple[int, int]]] = {}  # name -> sample -> (block, row)
        self.memory = self.disk = self.decoded = self.reused = self.not_kept = 0
        self.lock = threading.Lock()
        self._folder: str | None = None
        self._file: Any = None
        self._disk_full = False

    def has(self, name: str, start: int, stop: int) -> bool:
        """Whether every sample of ``[start, stop)`` of ``name`` is kept."""
        where = self.where.get(name, {})
        return all(i in where for i in range(start, stop))

    def get(self, name: str, start: int, stop: int) -> torch.Tensor | None:
        """Samples ``[start, stop)`` as kept, or None unless every one of them is."""
        with self.lock:
            where = self.where.get(name, {})
            spots = [where.get(i) for i in range(start, stop)]
            if not spots or any(spot is None for spot in spots):
                return None
            self.reused += len(spots)
            first_block, first_row = spots[0]  # type: ignore[misc]
            if all(spot == (first_block, first_row + j) for j, spot in enumerate(spots)):
                return self._block(first_block)[first_row : first_row + len(spots)]
            read: dict[int, torch.Tensor] = {}
            rows = []
            for block, row in spots:  # type: ignore[misc]
                if block not in read:
                    read[block] = self._block(block)
                rows.append(read[block][row])
            return torch.stack(rows)

    def put(self, name: str, start: int, kept: torch.Tensor) -> None:
        """Keep samples ``[start, start + len(kept))`` decoded by a pass (those not kept yet)."""
        with self.lock:
            self.decoded += len(kept)
            where = self.where.setdefault(name, {})
            if all(start + j in where for j in range(len(kept))) or len(kept) == 0:
                return
            if kept._base is not None or not kept.is_contiguous():
                kept = kept.contiguous().clone()  # own its bytes: not a view of a larger buffer
            nbytes = kept.numel() * kept.element_size()
            if self.memory + nbytes <= self.keep.memory_bytes:
                self.blocks.append(kept)
                self.memory += nbytes
            elif self.disk + nbytes <= self.keep.disk_bytes and not self._disk_full and self._spill(kept):
                self.disk += nbytes
            else:
                if self.keep.memory_bytes or self.keep.disk_bytes:  # asked to keep, no room left
                    self.not_kept += len(kept)
                return
            block = len(self.blocks) - 1
            for j in range(len(kept)):
                where.setdefault(start + j, (block, j))

    def counts(self) -> KeptCounts:
        return KeptCounts(self.decoded, self.reused, self.memory, self.disk, self.not_kept)

    def close(self) -> None:
        """Drop what is kept and remove the spill file."""
        with self.lock:
            self.blocks, self.where = [], {}
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
                self._folder = None

    def _spill(self, kept: torch.Tensor) -> bool:
        """Append a block to the spill file; False (and no more spilling) when the disk refuses."""
        try:
            if self._file is None:
                self._folder = tempfile.mkdtemp(prefix="bnrecal-kept-", dir=self.keep.spill_root)
                self._file = open(os.path.join(self._folder, "samples.bin"), "w+b")  # noqa: SIM115 - kept open for the scope
            offset = self._file.seek(0, os.SEEK_END)
            self._file.write(kept.numpy().tobytes())
            self._file.flush()
        except OSError:
            self._disk_full = True
            return False
        self.blocks.append(_OnDisk(offset, tuple(kept.shape), kept.dtype))
        return True

    def _block(self, index: int) -> torch.Tensor:
        block = self.blocks[index]
        if isinstance(block, torch.Tensor):
            return block
        data = bytearray(os.pread(self._file.fileno(), block.nbytes, block.offset))
        return torch.frombuffer(data, dtype=block.dtype).reshape(block.shape)


class DecodedStore:
    """The process's kept samples, by scope. With ``one_scope`` (a rank actor) a new scope
    drops every other: a rank serves one job at a time."""

    def __init__(self, one_scope: bool = False) -> None:
        self.one_scope = one_scope
        self._scopes: dict[str, _Scope] = {}
        self._lock = threading.Lock()

    def scope(self, keep: KeepDecoded) -> _Scope:
        """The scope ``keep`` names, made on first use with its budgets."""
        with self._lock:
            found = self._scopes.get(keep.scope)
            if found is not None:
                return found
            dropped = list(self._scopes.values()) if self.one_scope else []
            if self.one_scope:
                self._scopes.clear()
            made = self._scopes[keep.scope] = _Scope(keep)
        for old in dropped:
            old.close()
        return made

    def scopes(self) -> list[str]:
        """The scopes this process keeps samples for now."""
        with self._lock:
            return list(self._scopes)

    def release(self, scope: str) -> KeptCounts:
        """Drop a scope's samples; what its passes decoded and reused (zeros for a scope not here)."""
        with self._lock:
            found = self._scopes.pop(scope, None)
        if found is None:
            return KeptCounts()
        counts = found.counts()
        found.close()
        return counts


STORE = DecodedStore()
"""This process's kept samples (a rank actor makes it one scope at a time: :func:`keep_one_scope`)."""


def keep_one_scope() -> None:
    """Make this process's store keep one scope at a time (a rank actor's)."""
    STORE.one_scope = True


def open_kept(spec: Any, opened: CalibrationData) -> CalibrationData:
    """``opened`` (the data of ``spec``, opened for a pass) read through what this process
    keeps of it, when the run asked to keep ``spec``'s samples and they cost a decode."""
    keep: KeepDecoded | None = getattr(spec, "keep", None)
    if keep is None or not opened.worth_keeping:
        return opened
    return KeptData(opened, STORE.scope(keep), keep.name)


def release_kept(scope: str) -> KeptCounts:
    """Drop this process's samples of ``scope``; what its passes decoded and reused."""
    return STORE.release(scope)


class KeptData(CalibrationData):
    """An opened dataset read through a scope's kept samples: a sample decoded by an earlier
    pass is not decoded again."""

    def __init__(self, inner: CalibrationData, scope: _Scope, name: str) -> None:
        self.inner = inner
        self.scope = scope
        self.name = name
        self.sample_shape = inner.sample_shape

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def decodes(self) -> bool:
        return self.inner.decodes

    @property
    def worth_keeping(self) -> bool:
        return False  # kept already

    def load(self, start: int, stop: int) -> torch.Tensor:
        """Samples ``[start, stop)``: as kept, else decoded (and kept)."""
        self._check_range(start, stop)
        kept = self.scope.get(self.name, start, stop) if stop > start else None
        if kept is None:
            kept = self.inner.load_kept(start, stop)
            self.scope.put(self.name, start, kept)
        return self._finished(kept)

    def missing(self, ranges: Sequence[tuple[int, int]]) -> list[bool]:
        """For each range, whether a sample of it is not kept (a pass decodes it)."""
        return [stop > start and not self.scope.has(self.name, start, stop) for start, stop in ranges]

    def finish(self, start: int, kept: torch.Tensor) -> torch.Tensor:
        """A range decoded elsewhere (a DataLoader worker's ``load_kept``): keep it, and
        give it as ``load`` would."""
        self.scope.put(self.name, start, kept)
        return self._finished(kept)

    def kept_batches(self, ranges: Sequence[tuple[int, int]], decoded: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
        """One batch per range, in order: kept ranges from the scope, the others taken in
        order from ``decoded`` (their ``load_kept`` batches) and kept."""
        for (start, stop), needed in zip(ranges, self.missing(ranges)):
            if needed:
                yield self.finish(start, next(decoded))
            else:
                yield self.load(start, stop)

    def close(self) -> None:
        self.inner.close()

    def _finished(self, kept: torch.Tensor) -> torch.Tensor:
        out = self.inner.from_kept(kept)
        if out.data_ptr() == kept.data_ptr() and out.numel():  # the pass gets its own tensor, never the kept one
            out = out.clone()
        return out
