"""What every opened calibration dataset offers (:class:`CalibrationData`), what every
format's part of a dataset's description offers (:class:`DataPart`) over what it sees of the
description's header (:class:`Described`), what a format's description gives that header
(:class:`FormatDescription`), how a format of single files says a file is its own
(:class:`FileFormat`), and how a format of shards finds its shards in what detection shows it
(:class:`ShardCandidate`, :class:`FoundShards`), then reads and counts one shard
(:class:`ShardFormat`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from bnrecal.errors import DatasetError
    from bnrecal.workers.data.storage.files import Place, ShardRef
    from bnrecal.workers.data.summary import DatasetSummary


@dataclass(frozen=True)
class FileFormat:
    """A format a dataset's single file can be, as its module declares it for detection
    (``workers.data.file_formats``): its name, the extensions that name it, which reader
    takes a file of it that is not already a dataset of shards (``arrays``: described and
    read in place, on disk or in S3; ``archive``: images, unpacked first; ``shards``: read as
    shards, each in place), and ``sniff``, whether a file's first 512 bytes (and the file, for
    an archive's listing) say it is one, for a file stored without an extension (an uploaded
    blob); ``None`` where only an extension says so."""

    name: str
    suffixes: tuple[str, ...]
    reads_as: Literal["arrays", "archive", "shards"]
    sniff: Callable[[bytes, Path], bool] | None = None

    def names(self, file_name: str) -> bool:
        """Whether a file's name carries one of this format's extensions."""
        return file_name.lower().endswith(self.suffixes)

    def sniffs(self, head: bytes, path: Path) -> bool:
        """Whether a file's leading bytes say it is of this format (never, without a sniff)."""
        return self.sniff is not None and self.sniff(head, path)


@dataclass(frozen=True)
class ShardSource:
    """One shard as its format's reader and counter are given it: the file (``ref``), its
    place among the dataset's shards, its row groups (Parquet and Arrow, once counted), the
    columns asked for, the format's own index of all the shards read when they were found
    (``listing``: MDS's ``MdsIndex``; None for formats whose shards describe themselves),
    where object storage answers and where tar indexes are cached."""

    ref: ShardRef
    position: int
    role: str
    groups: tuple[int, ...] = ()
    image_column: str | None = None
    label_column: str | None = None
    listing: Any = None
    endpoint_url: str | None = None
    cache_root: Path | None = None


@dataclass(frozen=True)
class ShardCount:
    """What counting one shard found: its samples, its row groups (or record batches) where
    its format has them, and the image column it read (None for a format without columns)."""

    rows: int
    groups: tuple[int, ...] = ()
    image_column: str | None = None


class ShardReader(Protocol):
    """A reader of one shard's samples and labels, as a rank holds it."""

    def read(self, rows: list[int]) -> list[tuple[str, bytes]]:
        """``(name within the shard, encoded sample)`` of each row (ascending)."""
        ...

    def encoded_bytes(self, rows: np.ndarray) -> int:
        """About how many bytes these rows' samples take encoded (what a read-ahead window counts)."""
        ...

    def labels(self) -> np.ndarray | None:
        """Each sample's class, in the shard's order."""
        ...

    def unlabelled(self, role: str) -> DatasetError | None:
        """Why the shard's samples have no labels, or None where they all have one."""
        ...

    def close(self) -> None:
        """Close what the reader opened."""
        ...


@dataclass(frozen=True)
class FoundShards:
    """A source told to be a dataset of shards: its format's name, its shards in order, and the
    format's own index of them where it has one (MDS's ``MdsIndex``), read once when found and
    described from."""

    format: str
    refs: list[ShardRef]
    listing: Any = None


class ShardCandidate(Protocol):
    """A local or S3 file or folder that may be a dataset of shards, as detection
    (``workers.data.shards.detection``) shows it to each format of shards in turn: what a
    format's ``find`` asks of it is the same wherever the bytes lie."""

    role: str
    shown: str  # what messages call it (an uploaded blob's file name, else its path or URI)
    shard_name: str  # what the file, read as one shard, is named (a blob's upload name, an object's)
    file_name: str  # its own name, whose extension tells a file's format (a blob's is its digest)
    is_folder: bool
    local: Path | None  # the local file or folder; None in S3 (an object is told by its name alone)

    def has(self, name: str) -> bool:
        """Whether the folder holds the file ``name`` (at its top)."""
        ...

    def names(self) -> Collection[str]:
        """The files at the folder's top."""
        ...

    def read(self, name: str | None = None, limit: int | None = None) -> bytes:
        """The folder's file ``name`` (None: the file itself), whole or its first ``limit`` bytes."""
        ...

    def refs(self, names: Sequence[str], where: str) -> list[ShardRef]:
        """The files ``names`` below the folder (or beside the file) as shards, in order, each
        as it is now (an object's listing is not trusted to be current); one missing fails
        naming it (on disk, saying ``where`` lists it)."""
        ...

    def itself(self, name: str) -> ShardRef:
        """The file as one shard called ``name``."""
        ...

    def tar_members(self) -> list[str]:
        """The first member files of a tar, in order (none for a file that is not a tar)."""
        ...


@dataclass(frozen=True)
class ShardFormat:
    """A format of shards, as its module declares it (listed in
    ``workers.data.shards.shard_formats``): its name (the report's data format), how it is
    named to a user, whether its samples sit in named columns (``image_column`` and
    ``label_column`` apply), whether rows are read cheaply in any order from a local
    uncompressed shard (a tar's members, MDS's offsets: no read-ahead window needed; row groups
    and record batches need one), how one shard is counted when the data is described, how
    a rank opens one, how it finds its shards in a file or folder (``find``: None where the
    candidate is not its own; tried in ``SHARD_FORMATS`` order) and the extensions that name
    its shards in a list, a folder or a manifest (``suffixes``; none where only its own
    layout names them)."""

    name: str
    shown: str
    columns: bool
    random_access: bool
    count: Callable[[ShardSource], ShardCount]
    open: Callable[[ShardSource], ShardReader]
    find: Callable[[ShardCandidate], FoundShards | None]
    suffixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class FormatDescription:
    """What a format's ``describe`` tells its dataset's header: its part, the path it reads (the
    file, the image folder after unpacking, or the URI), its samples before and after
    ``max_samples``, and one sample's shape as fed to the model."""

    part: DataPart
    path: str
    total_samples: int
    num_samples: int
    sample_shape: tuple[int, ...]


class Described(Protocol):
    """What a format's part sees of its dataset's description (the header of
    :class:`~workers.data.spec.DatasetSpec`): where the bytes live, how many samples of how
    many, one sample's shape, their order and the name the user knows."""

    @property
    def place(self) -> Place: ...

    num_samples: int
    total_samples: int
    sample_shape: tuple[int, ...]
    order: str

    @property
    def display_name(self) -> str: ...

    def sample_rows(self) -> np.ndarray: ...


class DataPart(Protocol):
    """A format's own part of a dataset's description: small, typed and picklable (it travels
    to the ranks). It opens the data, adds what its format says to the summary, reads the
    evaluation labels, and sets aside what does not change which samples are read."""

    kind: ClassVar[str]

    def open(self, described: Described) -> CalibrationData:
        """The data opened for reading (inside a rank); only ``load`` reads samples."""
        ...

    def summarise(self, summary: DatasetSummary) -> DatasetSummary:
        """``summary`` (the header's) with what this format adds."""
        ...

    def labels(self, described: Described) -> np.ndarray | None:
        """The class index of each sample (int64, in the samples' order), or None without labels."""
        ...

    def same_samples(self) -> DataPart:
        """This part with what does not change the samples read set aside (two descriptions
        that compare equal after it read the same samples)."""
        ...



class CalibrationData(ABC):
    """An opened calibration dataset: a fixed-order sequence of float32 samples.

    Opened inside the actor from a :class:`~workers.data.DatasetSpec`; ``load`` reads and
    converts only the requested samples.
    """

    sample_shape: tuple[int, ...]

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples (after ``max_samples``)."""

    @abstractmethod
    def load(self, start: int, stop: int) -> torch.Tensor:
        """Samples ``[start, stop)`` as a float32 tensor ``(stop - start, *sample_shape)``.

        ``start == stop`` gives an empty ``(0, *sample_shape)`` tensor, so a rank with an
        empty slice still has a batch to run its collectives with.
        """

    def load_kept(self, start: int, stop: int) -> torch.Tensor:
        """Samples ``[start, stop)`` in the form a rank keeps them between the passes of a
        job (``workers.data.reading.kept``): what ``load`` gives before its last, cheap step (uint8
        crops for images, before scaling and normalisation). ``from_kept`` finishes it."""
        return self.load(start, stop)

    def from_kept(self, kept: torch.Tensor) -> torch.Tensor:
        """Samples read by ``load_kept`` as ``load`` gives them, bit for bit."""
        return kept

    @property
    def decodes(self) -> bool:
        """Whether ``load`` does CPU-heavy decoding worth moving to DataLoader workers."""
        return False

    def encoded(self, start: int, stop: int) -> list[tuple[str, bytes]] | None:
        """Samples ``[start, stop)`` as their encoded bytes ``(name, bytes)``, for a decoder
        elsewhere (a CUDA rank's, ``workers.data.reading.device_decode``); None where the data has
        no encoded form (arrays)."""
        return None

    def first_encoded(self) -> tuple[str, bytes] | None:
        """The first sample this reader holds, encoded (None for arrays or an empty set):
        what a CUDA rank looks at to choose its decoder."""
        first = self.encoded(0, min(1, len(self)))
        return first[0] if first else None

    @property
    def worth_keeping(self) -> bool:
        """Whether reading a sample again costs a decode, so a rank keeps what it read for
        the job's later passes (``workers.data.reading.kept``); arrays read from a memory map are not."""
        return self.decodes

    def close(self) -> None:
        """Release open files and memory maps; ``load`` reopens them if called again."""

    def __enter__(self) -> CalibrationData:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_range(self, start: int, stop: int) -> None:
        """Refuse a range outside ``[0, len(self)]`` or with ``start > stop`` (a caller bug)."""
        if not (0 <= start <= stop <= len(self)):
            raise IndexError(f"sample range [{start}, {stop}) is outside [0, {len(self)})")

    def _empty(self) -> torch.Tensor:
        """The empty batch ``(0, *sample_shape)``."""
        return torch.empty((0, *self.sample_shape), dtype=torch.float32)


class DecodedData(CalibrationData):
    """Data whose samples are decoded (images, shards, shipped encoded samples): ``load`` is
    ``load_kept`` (the decode) finished by ``from_kept``, so what a pass reads and what a rank
    keeps for the job's later passes (``workers.data.reading.kept``) come from one decode."""

    def load(self, start: int, stop: int) -> torch.Tensor:
        """Samples ``[start, stop)`` as float32: decoded, then finished (scaled, normalised)."""
        return self.from_kept(self.load_kept(start, stop))

    @abstractmethod
    def load_kept(self, start: int, stop: int) -> torch.Tensor:
        """Samples ``[start, stop)`` decoded (image crops as uint8); a broken sample raises a
        DatasetError naming it."""

    @abstractmethod
    def from_kept(self, kept: torch.Tensor) -> torch.Tensor:
        """Decoded samples as ``load`` gives them, bit for bit."""
