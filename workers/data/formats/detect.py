"""Which format a data file is, from its extension or, for a file without one (an
uploaded blob), from its leading bytes; and an array file's sample shape from its header."""

from __future__ import annotations

import zipfile
from pathlib import Path

from bnrecal.workers.data.formats.npy_layout import describe_npy, describe_npz
from bnrecal.errors import DatasetError

SUFFIX_FORMATS = (
    (".npy", "npy"), (".npz", "npz"), (".zip", "zip"),
    (".tar", "tar"), (".tar.gz", "tar"), (".tgz", "tar"),
    (".tar.bz2", "tar"), (".tbz2", "tar"), (".tar.xz", "tar"), (".txz", "tar"),
    (".parquet", "parquet"), (".manifest", "manifest"), (".lst", "manifest"), (".txt", "manifest"),
)
EXPECTED = (
    "a .npy or .npz file, an image folder, a .tar, .tar.gz/.tgz or .zip archive of images, "
    "WebDataset .tar shards, Parquet files, a MosaicML Streaming (MDS) folder or a manifest of shards"
)


def detect_format(path: Path, role: str = "calibration data", name: str | None = None) -> str:
    """``npy``, ``npz``, ``tar``, ``zip``, ``parquet`` or ``manifest``: by the file's extension,
    else by its leading bytes (never ``manifest``: a blob is never read as one).

    ``name`` (an uploaded blob's file name) is only shown in the error: a blob is stored
    without an extension, so its format always comes from its content, whatever it was
    called when uploaded.
    """
    lower = path.name.lower()
    for suffix, data_format in SUFFIX_FORMATS:
        if lower.endswith(suffix):
            return data_format
    sniffed = _sniff_format(path)
    if sniffed is None:
        shown = name or path.name
        suffix = "".join(Path(shown).suffixes)
        extension = f"extension {suffix}" if suffix else "no extension"
        raise DatasetError(f"unknown {role} format {shown!r} ({extension}); expected {EXPECTED}")
    return sniffed


def _sniff_format(path: Path) -> str | None:
    with open(path, "rb") as stream:
        head = stream.read(512)
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except zipfile.BadZipFile:
            return None
        return "npz" if names and all(n.endswith(".npy") for n in names) else "zip"
    if head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")) or head[257:262] == b"ustar":
        return "tar"
    return None


def array_sample_shape(path: str | Path) -> tuple[int, ...] | None:
    """The shape of one sample of a ``.npy``/``.npz`` file, from its header alone; None for
    other data (images take their shape from the transform) or data that cannot be read
    (the job reports that as it reads it)."""
    file = Path(path)
    try:
        if not file.is_file():
            return None
        data_format = detect_format(file)
        if data_format not in ("npy", "npz"):
            return None
        layout = describe_npy(file) if data_format == "npy" else describe_npz(file)
    except (DatasetError, OSError):
        return None
    return tuple(layout.shape[1:])
