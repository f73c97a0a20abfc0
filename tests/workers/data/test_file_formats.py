"""Which format a single data file is: each format's own entry, by extension, else, for a
blob stored without one, by its leading bytes (workers/data/file_formats.py)."""

from __future__ import annotations

import ast
import io
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bnrecal.errors import DatasetError
from bnrecal.workers.data import FILE_FORMATS, detect_format, format_named
from bnrecal.workers.data.file_formats import array_sample_shape

ROOT = Path(__file__).parents[3]


def write_blobs(folder: Path) -> dict[str, Path]:
    """One file of each sniffable format, written by its ecosystem's own writer, with no extension."""
    blobs = {}
    np.save(folder / "a.npy", np.zeros((5, 3, 4), np.float32))
    np.savez(folder / "b.npz", x=np.zeros((2, 7), np.float32), y=np.arange(2))
    with zipfile.ZipFile(folder / "c.zip", "w") as archive:
        archive.writestr("cat/0.png", b"not looked at here")
    with tarfile.open(folder / "d.tar", "w") as archive:
        info = tarfile.TarInfo("cat/0.png")
        info.size = 3
        archive.addfile(info, io.BytesIO(b"png"))
    with tarfile.open(folder / "e.tar.gz", "w:gz") as archive:
        archive.add(folder / "d.tar", "inner.tar")
    pq.write_table(pa.table({"image": [b"x"], "label": [0]}), folder / "f.parquet")
    for name, file_format in (("a.npy", "npy"), ("b.npz", "npz"), ("c.zip", "zip"), ("d.tar", "tar"),
                              ("e.tar.gz", "tar"), ("f.parquet", "parquet")):
        blob = folder / f"blob-{name.replace('.', '-')}"
        blob.write_bytes((folder / name).read_bytes())
        blobs[f"{name}={file_format}"] = blob
    return blobs


def test_a_blob_is_told_by_its_bytes_a_named_file_by_its_extension(tmp_path: Path) -> None:
    for case, blob in write_blobs(tmp_path).items():
        name, expected = case.split("=")
        assert detect_format(blob).name == expected, case
        assert detect_format(tmp_path / name).name == expected, case
        assert format_named(name) is not None and format_named(name).name == expected
    assert format_named("shards.LST").name == "manifest" and format_named("x.tbz2").name == "tar"
    assert format_named("table.csv") is None


def test_an_npz_is_a_zip_of_arrays_and_a_zip_with_one_other_member_is_an_archive(tmp_path: Path) -> None:
    np.savez(tmp_path / "x.npz", x=np.zeros(3))
    with zipfile.ZipFile(tmp_path / "x.npz", "a") as archive:
        archive.writestr("notes.txt", b"not an array")
    (tmp_path / "blob").write_bytes((tmp_path / "x.npz").read_bytes())
    assert detect_format(tmp_path / "blob").name == "zip"


def test_a_blob_is_never_a_manifest_and_unknown_bytes_fail_naming_the_upload(tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    blob.write_text("a.tar\nb.tar\n")
    with pytest.raises(DatasetError, match=r"unknown evaluation data format 'shards\.txt' \(extension \.txt\)"):
        detect_format(blob, "evaluation data", "shards.txt")
    assert detect_format(tmp_path.joinpath("list.txt")).name == "manifest"  # named: not even read


def test_array_sample_shape_reads_only_array_headers(tmp_path: Path) -> None:
    blobs = write_blobs(tmp_path)
    assert array_sample_shape(blobs["a.npy=npy"]) == (3, 4)
    assert array_sample_shape(blobs["b.npz=npz"]) == (7,)
    assert array_sample_shape(blobs["d.tar=tar"]) is None
    assert array_sample_shape(tmp_path / "missing.npy") is None


def test_every_format_entry_a_module_declares_is_in_the_registry() -> None:
    """A format of single files is its module's ``FileFormat(...)`` and its place in
    FILE_FORMATS: one declared and not listed would never be detected."""
    declared = set()
    for path in (ROOT / "workers" / "data").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "FileFormat":
                declared.add(node.args[0].value)  # type: ignore[attr-defined]
    assert declared == {file_format.name for file_format in FILE_FORMATS}
    assert len(FILE_FORMATS) == len(declared)
