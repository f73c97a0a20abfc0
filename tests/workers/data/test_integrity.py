"""A rank hashes an uploaded blob (a file stored under its digest) before it reads a sample
of it, once per process, and refuses one whose bytes no longer match; other files are read
as they are."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from bnrecal.workers.data.formats.arrays import ArrayData
from bnrecal.workers.data.formats.npy_layout import describe_npy
from bnrecal.workers.data.storage.files import Place
from bnrecal.workers.data.integrity import content_address, verify_content_address
from bnrecal.errors import CorruptBlobError, InputError


def stored_blob(root: Path, array: np.ndarray) -> Path:
    """An array saved where the server's blob store would keep it: under its own digest."""
    staged = root / "staged.npy"
    np.save(staged, array)
    hex_digest = hashlib.sha256(staged.read_bytes()).hexdigest()
    target = root / "tenant" / "sha256" / hex_digest[:2] / hex_digest
    target.parent.mkdir(parents=True)
    staged.rename(target)
    return target


def flip_last_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


def test_content_addresses_are_told_by_their_path(tmp_path):
    hex_digest = "ab" + "0" * 62
    assert content_address(tmp_path / "t" / "sha256" / "ab" / hex_digest) == "sha256:" + hex_digest
    assert content_address(tmp_path / "t" / "sha256" / "cd" / hex_digest) is None  # shard does not match
    assert content_address(tmp_path / "calib.npy") is None


def test_a_rank_refuses_a_damaged_blob_before_its_first_sample(tmp_path):
    array = np.arange(64, dtype=np.float32).reshape(16, 4)
    blob = stored_blob(tmp_path, array)
    layout = describe_npy(blob)
    assert np.array_equal(ArrayData(Place(str(blob)), layout, 16).load(0, 16).numpy(), array)
    flip_last_byte(blob)  # a sample's bytes: the header still reads
    with pytest.raises(CorruptBlobError, match=r"data: blob sha256:[0-9a-f]{64} is corrupt") as raised:
        ArrayData(Place(str(blob)), layout, 16).load(0, 16)
    assert raised.value.field == "data" and isinstance(raised.value, InputError)


def test_a_file_outside_a_blob_store_is_read_as_it_is(tmp_path):
    plain = tmp_path / "calib.npy"
    np.save(plain, np.ones((4, 2), dtype=np.float32))
    verify_content_address(plain)  # nothing to check it against
    assert ArrayData(Place(str(plain)), describe_npy(plain), 4).load(0, 4).shape == (4, 2)
