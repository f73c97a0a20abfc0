"""The content-addressed blob store: digests, the streamed byte cap, tenants, atomicity."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bnrecal.service.jobserver.storage.blobs import MAX_FILENAME_CHARS, BlobStore, FileBlobStore, clean_filename, is_digest
from bnrecal.errors import NotFoundError, PayloadTooLargeError


async def _chunks(parts: list[bytes], consumed: list[int] | None = None) -> AsyncIterator[bytes]:
    for part in parts:
        if consumed is not None:
            consumed.append(len(part))
        yield part


def ingest(store: BlobStore, tenant: str, parts: list[bytes], cap: int = 1 << 30, consumed: list[int] | None = None,
           filename: str | None = None):
    return asyncio.run(store.ingest(tenant, _chunks(parts, consumed), cap, filename))


def files_under(root: Path) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file()]


def test_same_bytes_give_the_sha256_digest_and_one_file(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    payload = os.urandom(3 * 1024 * 1024 + 17)
    parts = [payload[i : i + 65536] for i in range(0, len(payload), 65536)]
    first = ingest(store, "alice", parts)
    again = ingest(store, "alice", [payload])
    assert first.digest == again.digest == "sha256:" + hashlib.sha256(payload).hexdigest()
    assert first.size == len(payload) and is_digest(first.digest)
    stored = store.path("alice", first.digest)
    assert stored.read_bytes() == payload
    assert files_under(store.root) == [stored]  # no staging leftovers, no duplicate


def test_the_cap_stops_the_stream_and_leaves_nothing(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    consumed: list[int] = []
    parts = [b"x" * 1000] * 50
    with pytest.raises(PayloadTooLargeError, match="BNRECAL_MAX_UPLOAD_BYTES"):
        ingest(store, "alice", parts, cap=4500, consumed=consumed)
    assert sum(consumed) == 5000  # stopped at the first chunk past the cap, not at the end
    assert files_under(store.root) == []


def test_exactly_the_cap_is_accepted(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    assert ingest(store, "alice", [b"a" * 10, b"b" * 10], cap=20).size == 20


def test_a_broken_stream_leaves_nothing(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")

    async def broken() -> AsyncIterator[bytes]:
        yield b"partial data"
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        asyncio.run(store.ingest("alice", broken(), 1 << 20))
    assert files_under(store.root) == []


def test_tenants_do_not_see_each_others_blobs(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    info = ingest(store, "alice", [b"alice's weights"])
    assert store.exists("alice", info.digest)
    assert not store.exists("bob", info.digest)
    with pytest.raises(NotFoundError, match="for this API key"):
        store.path("bob", info.digest)
    bobs = ingest(store, "bob", [b"alice's weights"])
    assert bobs.digest == info.digest and store.path("bob", info.digest) != store.path("alice", info.digest)


@pytest.mark.parametrize("digest", ["sha256:abc", "md5:" + "0" * 32, "../../etc/passwd", "sha256:" + "G" * 64])
def test_malformed_digests_are_not_found(tmp_path, digest):
    store = FileBlobStore(tmp_path / "blobs")
    with pytest.raises(NotFoundError):
        store.path("alice", digest)
    assert not store.exists("alice", digest)


def test_adopt_stores_an_artifact_under_its_digest(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    artifact = tmp_path / "model.onnx"
    artifact.write_bytes(b"onnx bytes" * 1000)
    info = store.adopt("alice", artifact)  # moved into the store: the work file is gone
    assert info.digest == "sha256:" + hashlib.sha256(b"onnx bytes" * 1000).hexdigest()
    assert store.path("alice", info.digest).read_bytes() == b"onnx bytes" * 1000


def test_clear_staging_removes_half_written_uploads(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    (store.root / ".staging" / "upload-crashed.part").write_bytes(b"half")
    FileBlobStore(tmp_path / "blobs").clear_staging()
    assert files_under(store.root) == []


def test_an_upload_keeps_its_file_name_per_tenant_and_the_latest_name_wins(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    first = ingest(store, "alice", [b"weights"], filename="model.pt")
    assert first.filename == "model.pt" and store.filename("alice", first.digest) == "model.pt"
    assert store.info("alice", first.digest).filename == "model.pt"
    assert ingest(store, "alice", [b"weights"]).filename == "model.pt"  # no name: the earlier one stays
    assert ingest(store, "alice", [b"weights"], filename="renamed.pt").filename == "renamed.pt"
    assert store.filename("alice", first.digest) == "renamed.pt"
    assert ingest(store, "bob", [b"weights"]).filename is None  # bob's copy has its own (no) name
    assert store.path("alice", first.digest).read_bytes() == b"weights"  # the name never moves the blob


def test_a_store_written_without_names_still_serves_its_blobs(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    info = ingest(store, "alice", [b"old data"])
    assert files_under(store.root) == [store.path("alice", info.digest)]  # nothing beside the blob
    reopened = FileBlobStore(tmp_path / "blobs")
    assert reopened.info("alice", info.digest) == info and info.filename is None
    assert reopened.filename("alice", "sha256:" + "0" * 64) is None
    assert reopened.filename("alice", "../../etc/passwd") is None


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("calib.txt", "calib.txt"),
        ("C:\\Users\\me\\calib.npy", "calib.npy"),
        ("../../etc/passwd", "passwd"),
        ("two\nlines\x00.npy", "twolines.npy"),
        ("\u202egnp.exe", "gnp.exe"),  # a right-to-left override cannot disguise the name
        ("caf\u00e9 photos", "caf\u00e9 photos"),
        ("..", None), ("dir/", None), ("   ", None), ("", None), (None, None),
    ],
)
def test_file_names_are_only_a_safe_display_name(given, kept):
    assert clean_filename(given) == kept


def test_an_overlong_file_name_is_cut(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    info = ingest(store, "alice", [b"x"], filename="n" * 1000 + ".npy")
    assert info.filename == "n" * MAX_FILENAME_CHARS
