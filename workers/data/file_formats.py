"""Which format a dataset's single file is: the formats' own :class:`FileFormat` entries, each
declared in its format's module (arrays' ``npy`` and ``npz``, archives' ``zip`` and ``tar``,
``parquet``, shards' ``manifest``), tried in order, by the file's extension, else, for a
file without a known one (an uploaded blob, stored under its digest), by its leading bytes.

A new format of single files is its entry in its module and its place in
:data:`FILE_FORMATS`; what reads it follows from its ``reads_as``.
"""

from __future__ import annotations

from pathlib import Path

from bnrecal.errors import DatasetError
from bnrecal.workers.data.formats.archive import TAR, ZIP
from bnrecal.workers.data.formats.arrays import NPY, NPZ
from bnrecal.workers.data.formats.columnar import PARQUET
from bnrecal.workers.data.formats.npy_layout import describe_npy, describe_npz
from bnrecal.workers.data.opened import FileFormat
from bnrecal.workers.data.shards.listing import MANIFEST

FILE_FORMATS: tuple[FileFormat, ...] = (NPY, NPZ, ZIP, TAR, PARQUET, MANIFEST)
"""Every format a single data file can be, in the order their leading bytes are tried (an
``.npz`` is a zip whose members are arrays, so it comes before ``zip``)."""

EXPECTED = (
    "a .npy or .npz file, an image folder, a .tar, .tar.gz/.tgz or .zip archive of images, "
    "WebDataset .tar shards, Parquet files, a MosaicML Streaming (MDS) folder or a manifest of shards"
)
_HEAD_BYTES = 512


def format_named(file_name: str) -> FileFormat | None:
    """The format a file's extension names, or None (an object in S3 is told by its name alone)."""
    return next((file_format for file_format in FILE_FORMATS if file_format.names(file_name)), None)


def detect_format(path: Path, role: str = "calibration data", name: str | None = None) -> FileFormat:
    """The format of a local file: the one its extension names, else the first whose leading
    bytes match (never ``manifest``: a blob is never read as one).

    ``name`` (an uploaded blob's file name) is only shown in the error: a blob is stored
    without an extension, so its format always comes from its content, whatever it was
    called when uploaded.
    """
    named = format_named(path.name)
    if named is not None:
        return named
    with open(path, "rb") as stream:
        head = stream.read(_HEAD_BYTES)
    sniffed = next((file_format for file_format in FILE_FORMATS if file_format.sniffs(head, path)), None)
    if sniffed is None:
        shown = name or path.name
        suffix = "".join(Path(shown).suffixes)
        extension = f"extension {suffix}" if suffix else "no extension"
        raise DatasetError(f"unknown {role} format {shown!r} ({extension}); expected {EXPECTED}")
    return sniffed


def array_sample_shape(path: str | Path) -> tuple[int, ...] | None:
    """The shape of one sample of a ``.npy``/``.npz`` file, from its header alone; None for
    other data (images take their shape from the transform) or data that cannot be read
    (the job reports that as it reads it)."""
    file = Path(path)
    try:
        if not file.is_file():
            return None
        file_format = detect_format(file)
        if file_format.reads_as != "arrays":
            return None
        layout = describe_npy(file) if file_format is NPY else describe_npz(file)
    except (DatasetError, OSError):
        return None
    return tuple(layout.shape[1:])
