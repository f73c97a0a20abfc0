"""Parquet files and Hugging Face ``save_to_disk`` folders (Arrow): an image column of
encoded bytes (a ``{bytes, path}`` struct, as Hugging Face writes an ``Image`` feature, or
plain binary) and an optional integer ``label`` column, read with pyarrow.

Columns: ``image_column`` (default ``image``; when the file has no such column and exactly
one column holds image bytes, that one) and ``label_column`` (default ``label``, needed for
evaluation only). A Parquet shard's index is its row groups' row counts, from its footer;
a rank reads only the row groups its samples lie in, one column chunk each (ranged reads
on S3). An Arrow file (``data-00000-of-00001.arrow``, the IPC stream format ``datasets``
writes) has no footer: its record batches are counted once and read forward, memory-mapped
locally. :data:`PARQUET_SHARDS` and :data:`ARROW_SHARDS` are how the shards' room counts and
opens one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import IO, Any

import numpy as np

from bnrecal.workers.data.storage.reads import open_random_access, open_shard
from bnrecal.workers.data.opened import FileFormat, FoundShards, ShardCandidate, ShardCount, ShardFormat, ShardSource
from bnrecal.workers.data.storage.files import PARQUET_SUFFIXES, ShardRef
from bnrecal.errors import DatasetError, DatasetOptionError, message_line

PARQUET_MAGIC = b"PAR1"  # a Parquet file's first (and last) four bytes
PARQUET = FileFormat("parquet", PARQUET_SUFFIXES, "shards", lambda head, path: head.startswith(PARQUET_MAGIC))
"""A Parquet file is a shard of its own (its row groups read in place), named or sniffed."""

DEFAULT_IMAGE_COLUMN = "image"
DEFAULT_LABEL_COLUMN = "label"
STATE_FILE = "state.json"
INFO_FILE = "dataset_info.json"
DICT_FILE = "dataset_dict.json"
UNLABELLED_INSTEAD = (
    "evaluation shards need every sample's class; unlabelled evaluation data is an .npy, an .npz without y "
    "or images without class folders"
)
"""What an evaluation shard without labels is told to do instead (docs/evaluation.md, "Evaluation data")."""


def _pyarrow() -> Any:
    import pyarrow  # imported on first use: array and image data never pay for it
    import pyarrow.ipc  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    return pyarrow


def save_to_disk_names(names: Collection[str], read: Callable[[str], bytes], shown: str, role: str) -> list[str]:
    """The Arrow files of a ``save_to_disk`` folder whose top-level files are ``names``, in
    ``state.json``'s order, its JSON files read with ``read(name)``; ``shown`` is the folder as
    the user named it. A DatasetDict is refused, naming its splits and a split's folder to give."""
    if DICT_FILE in names:
        try:
            splits = [str(split) for split in json.loads(read(DICT_FILE))["splits"]]
        except (OSError, ValueError, KeyError, TypeError):
            splits = []
        listed = f"splits {', '.join(splits)}" if splits else "several splits"
        example = f", e.g. {shown.rstrip('/')}/{splits[0]}" if splits else ""
        raise DatasetError(
            f"{shown} holds a DatasetDict with {listed}, not one dataset: "
            f"give one split's folder as the {role}{example}"
        )
    try:
        files = [str(entry["filename"]) for entry in json.loads(read(STATE_FILE))["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{shown}/{STATE_FILE} does not list the dataset's Arrow files: {message_line(exc)}") from exc
    for name in files:
        if "/" in name or name.startswith(".") or name not in names:
            raise DatasetError(f"{shown}: Arrow file {name} named in {STATE_FILE} is missing")
    if not files:
        raise DatasetError(f"{shown} holds no Arrow files")
    return files


def _image_cells(column: Any, ref: ShardRef, name: str) -> Any:
    """The encoded bytes of an image column (a ``{bytes, path}`` struct or binary)."""
    pa = _pyarrow()
    kind = column.type
    if pa.types.is_struct(kind):
        if kind.get_field_index("bytes") < 0:
            raise DatasetError(f"{ref.name}: image column {name!r} is a struct without a 'bytes' field")
        return column.field("bytes")
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return column
    raise DatasetError(f"{ref.name}: column {name!r} is {kind}, not image bytes (binary or {{bytes, path}})")


def _bytes_columns(schema: Any) -> list[str]:
    """The columns of a schema that can hold encoded images (binary, or ``{bytes, path}``)."""
    pa = _pyarrow()
    return [
        field.name for field in schema
        if pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type)
        or (pa.types.is_struct(field.type) and field.type.get_field_index("bytes") >= 0)
    ]


def image_column_of(schema: Any, wanted: str | None, ref: ShardRef) -> str:
    """The column holding the images: ``wanted`` (which must exist), else ``image``, else the
    only column of encoded bytes; a miss names the columns there are and the option to set."""
    names = list(schema.names)
    if wanted is not None and wanted in names:
        return wanted
    if wanted is None and DEFAULT_IMAGE_COLUMN in names:
        return DEFAULT_IMAGE_COLUMN
    candidates = _bytes_columns(schema)
    if wanted is None and len(candidates) == 1:
        return candidates[0]
    missing = f"no image column {wanted!r}" if wanted is not None else f"no column {DEFAULT_IMAGE_COLUMN!r}"
    fix = (
        f"set image_column to the one holding the images (columns of bytes: {', '.join(candidates)})" if candidates
        else "no column holds encoded image bytes (binary, or a {bytes, path} struct as datasets' Image feature writes)"
    )
    raise DatasetOptionError(f"{ref.name} has {missing} (columns: {', '.join(names)}); {fix}", field="image_column")


class ColumnarReader:
    """Samples of one Parquet or Arrow shard: the image cells of the rows asked for, and the labels."""

    def __init__(self, ref: ShardRef, fmt: str, image_column: str | None, label_column: str | None,
                 endpoint_url: str | None, groups: tuple[int, ...] = ()) -> None:
        self.ref = ref
        self.format = fmt
        self.groups = groups
        self.image_column = image_column
        self.label_column = label_column or DEFAULT_LABEL_COLUMN
        self.endpoint_url = endpoint_url
        self._file: IO[bytes] | None = None
        self._parquet: Any = None

    def counts(self) -> tuple[int, list[int]]:
        """``(rows, rows per row group or record batch)``, checking the image column exists."""
        if self.format == "parquet":
            meta = self._parquet_file().metadata
            self.image_column = image_column_of(self._parquet_file().schema_arrow, self.image_column, self.ref)
            return meta.num_rows, [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        sizes = []
        for batch in self._batches(None):
            if not sizes:
                self.image_column = image_column_of(batch.schema, self.image_column, self.ref)
            sizes.append(batch.num_rows)
        return sum(sizes), sizes

    def read(self, rows: list[int]) -> list[tuple[str, bytes]]:
        """``(name, bytes)`` of each row (ascending) of this shard, by the row counts of its row
        groups (or record batches) it was opened with, from :meth:`counts`."""
        bounds = np.cumsum([0, *self.groups])
        which = np.searchsorted(bounds, rows, side="right") - 1
        out: list[tuple[str, bytes]] = []
        wanted = sorted(set(which.tolist()))
        for group, table in self._groups(wanted):
            local = [r - int(bounds[group]) for r, g in zip(rows, which.tolist()) if g == group]
            column = table.column(self.image_column)
            column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
            cells = _image_cells(column, self.ref, self.image_column or "")
            for row, value in zip(local, cells.take(local).to_pylist()):
                name = f"row {int(bounds[group]) + row}"
                if value is None:
                    raise self._without_bytes(column, row, name)
                out.append((name, value))
        return out

    def _without_bytes(self, column: Any, row: int, name: str) -> DatasetError:
        """The error of a cell without image bytes: empty, or holding only a path (what
        ``datasets`` writes for an ``Image`` column cast from file paths), which is never
        followed: the fix is to embed the files' bytes."""
        pa = _pyarrow()
        kind = column.type
        paths = pa.types.is_struct(kind) and kind.get_field_index("path") >= 0
        path = column.field("path")[row].as_py() if paths else None
        where = f"{self.ref.name}: {name} of column {self.image_column!r}"
        if not path:
            return DatasetError(f"{where} is empty: store every row's encoded image, or drop the rows without one")
        return DatasetError(
            f"{where} holds only a path ({path}), not the image's bytes: embed the images in the file, e.g. with "
            "datasets: ds.with_format('arrow').map(datasets.table.embed_table_storage, batched=True).to_parquet(PATH), "
            "or give the folder ds.save_to_disk(PATH) writes"
        )

    def encoded_bytes(self, rows: np.ndarray) -> int:
        """A guess of these rows' encoded bytes (128 KiB a row: the footer does not say)."""
        return len(rows) * 128 * 1024

    def labels(self) -> np.ndarray | None:
        """Each row's class from the label column, or None when there is no such column."""
        pa = _pyarrow()
        if self.format == "parquet":
            pf = self._parquet_file()
            if self.label_column not in pf.schema_arrow.names:
                return None
            column = pf.read(columns=[self.label_column]).column(0)
        else:
            parts = [b.column(self.label_column) for b in self._batches(None) if self.label_column in b.schema.names]
            if not parts:
                return None
            column = pa.chunked_array(parts)
        if not pa.types.is_integer(column.type):
            raise DatasetError(f"{self.ref.name}: label column {self.label_column!r} is {column.type}, not integer classes")
        if column.null_count:
            raise DatasetError(f"{self.ref.name}: label column {self.label_column!r} has empty cells")
        values = np.asarray(column.to_numpy(), dtype=np.int64)
        if values.size and int(values.min()) < 0:
            raise DatasetError(f"{self.ref.name}: label column {self.label_column!r} holds {int(values.min())}; classes are >= 0")
        return values

    def unlabelled(self, role: str) -> DatasetError | None:
        """Why evaluation cannot read this shard's labels (it has no label column: the error
        names the columns there are and the option to set), or None."""
        pa = _pyarrow()
        schema = self._parquet_file().schema_arrow if self.format == "parquet" else self._arrow_schema()
        if self.label_column in schema.names:
            return None
        integers = [field.name for field in schema if pa.types.is_integer(field.type)]
        fix = (
            f"set label_column to its column of integer classes (integer columns: {', '.join(integers)})" if integers
            else f"it has no integer column to take the classes from: {UNLABELLED_INSTEAD}"
        )
        return DatasetOptionError(
            f"{role}: {self.ref.name} has no label column {self.label_column!r} "
            f"(columns: {', '.join(schema.names)}); {fix}",
            field="label_column",
        )

    def _arrow_schema(self) -> Any:
        """The schema of an Arrow file, from its first record batch."""
        for batch in self._batches(0):
            return batch.schema
        return _pyarrow().schema([])

    def _parquet_file(self) -> Any:
        if self._parquet is None:
            pa = _pyarrow()
            self._file = open_random_access(self.ref, self.endpoint_url)
            try:
                self._parquet = pa.parquet.ParquetFile(self._file)
            except (pa.ArrowInvalid, OSError) as exc:
                self.close()
                raise DatasetError(f"{self.ref.name} is not a valid Parquet file: {message_line(exc)}") from exc
        return self._parquet

    def _groups(self, wanted: list[int]) -> Any:
        pa = _pyarrow()
        columns = [self.image_column]
        try:
            if self.format == "parquet":
                for group in wanted:
                    yield group, self._parquet_file().read_row_group(group, columns=columns)
                return
            targets = set(wanted)
            for group, batch in enumerate(self._batches(max(wanted))):
                if group in targets:
                    yield group, batch
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            raise DatasetError(f"{self.ref.name} is truncated or corrupt: {message_line(exc)}") from exc

    def _batches(self, last: int | None) -> Any:
        """The record batches of an Arrow stream file, up to batch ``last``."""
        pa = _pyarrow()
        source: Any = pa.memory_map(self.ref.location) if not self.ref.remote and self.ref.offset == 0 \
            else open_shard(self.ref, self.endpoint_url)
        try:
            with source:
                try:
                    reader = pa.ipc.open_stream(source)
                except pa.ArrowInvalid:
                    source.seek(0)
                    file_reader = pa.ipc.open_file(source)
                    for i in range(file_reader.num_record_batches if last is None else last + 1):
                        yield file_reader.get_batch(i)
                    return
                for i, batch in enumerate(reader):
                    yield batch
                    if last is not None and i >= last:
                        return
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{self.ref.name} is not a valid Arrow file or is truncated: {message_line(exc)}") from exc

    def close(self) -> None:
        """Close the open Parquet file (the next read reopens it)."""
        self._parquet = None
        if self._file is not None:
            self._file.close()
        self._file = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_parquet": None}


def _find_parquet(candidate: ShardCandidate) -> FoundShards | None:
    """A ``.parquet`` file (or, on disk, a file starting with Parquet's magic bytes: an upload)
    is one shard."""
    if candidate.is_folder:
        return None
    if not PARQUET.names(candidate.file_name) and not (
            candidate.local is not None and PARQUET.sniffs(candidate.read(limit=4), candidate.local)):
        return None
    name = candidate.shard_name
    return FoundShards("parquet", [candidate.itself(name if PARQUET.names(name) else f"{name}.parquet")])


def _find_arrow(candidate: ShardCandidate) -> FoundShards | None:
    """A ``datasets`` ``save_to_disk`` folder (a Dataset's ``state.json`` and
    ``dataset_info.json``; a DatasetDict's ``dataset_dict.json`` is refused, naming a split to
    give) is its Arrow files, in ``state.json``'s order."""
    if not candidate.is_folder or not (
            candidate.has(DICT_FILE) or (candidate.has(STATE_FILE) and candidate.has(INFO_FILE))):
        return None
    files = save_to_disk_names(candidate.names(), lambda name: candidate.read(name), candidate.shown, candidate.role)
    return FoundShards("arrow", candidate.refs(files, f"{candidate.role}: {candidate.shown}/{STATE_FILE}"))


def _columnar_format(
    name: str, shown: str, find: Callable[[ShardCandidate], FoundShards | None], suffixes: tuple[str, ...] = (),
) -> ShardFormat:
    """The shard format of Parquet files or Arrow files, read by :class:`ColumnarReader`."""

    def count(source: ShardSource) -> ShardCount:
        reader = ColumnarReader(source.ref, name, source.image_column, source.label_column, source.endpoint_url)
        try:
            rows, groups = reader.counts()
        finally:
            reader.close()
        return ShardCount(rows, tuple(groups), reader.image_column)

    def open_reader(source: ShardSource) -> ColumnarReader:
        return ColumnarReader(source.ref, name, source.image_column, source.label_column, source.endpoint_url,
                              source.groups)

    return ShardFormat(name, shown, columns=True, random_access=False, count=count, open=open_reader, find=find,
                       suffixes=suffixes)


PARQUET_SHARDS = _columnar_format("parquet", "Parquet", _find_parquet, PARQUET_SUFFIXES)
"""Parquet files: an image column, read by row group."""
ARROW_SHARDS = _columnar_format("arrow", "Arrow", _find_arrow)
"""A ``save_to_disk`` folder's Arrow files: an image column, read by record batch, forward."""
