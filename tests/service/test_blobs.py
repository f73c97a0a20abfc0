"""The content-addressed blob store: digests, the streamed byte cap, tenants, atomicity."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from service.blobs import BlobStore, is_digest
from workers.errors import NotFoundError, PayloadTooLargeError


async def _chunks(parts: list[bytes], consumed: list[int] | None = None) -> AsyncIterator[bytes]:
    for part in parts:
        if consumed is not None:
            consumed.append(len(part))
        yield part


def ingest(store: BlobStore, tenant: str, parts: list[bytes], cap: int = 1 << 30, consumed: list[int] | None = None):
    return asyncio.run(store.ingest(tenant, _chunks(parts, consumed), cap))


def files_under(root: Path) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file()]


def test_same_bytes_give_the_sha256_digest_and_one_file(tmp_path):
    store = BlobStore(tmp_path / "blobs")
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
    store = BlobStore(tmp_path / "blobs")
    consumed: list[int] = []
    parts = [b"x" * 1000] * 50
    with pytest.raises(PayloadTooLargeError, match="BNRECAL_MAX_UPLOAD_BYTES"):
        ingest(store, "alice", parts, cap=4500, consumed=consumed)
    assert sum(consumed) == 5000  # stopped at the first chunk past the cap, not at the end
    assert files_under(store.root) == []


def test_exactly_the_cap_is_accepted(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    assert ingest(store, "alice", [b"a" * 10, b"b" * 10], cap=20).size == 20


def test_a_broken_stream_leaves_nothing(tmp_path):
    store = BlobStore(tmp_path / "blobs")

    async def broken() -> AsyncIterator[bytes]:
        yield b"partial data"
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        asyncio.run(store.ingest("alice", broken(), 1 << 20))
    assert files_under(store.root) == []


def test_tenants_do_not_see_each_others_blobs(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    info = ingest(store, "alice", [b"alice's weights"])
    assert store.exists("alice", info.digest)
    assert not store.exists("bob", info.digest)
    with pytest.raises(NotFoundError, match="for this API key"):
        store.path("bob", info.digest)
    bobs = ingest(store, "bob", [b"alice's weights"])
    assert bobs.digest == info.digest and store.path("bob", info.digest) != store.path("alice", info.digest)


@pytest.mark.parametrize("digest", ["sha256:abc", "md5:" + "0" * 32, "../../etc/passwd", "sha256:" + "G" * 64])
def test_malformed_digests_are_not_found(tmp_path, digest):
    store = BlobStore(tmp_path / "blobs")
    with pytest.raises(NotFoundError):
        store.path("alice", digest)
    assert not store.exists("alice", digest)


def test_adopt_stores_an_artifact_under_its_digest(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    artifact = tmp_path / "model.onnx"
    artifact.write_bytes(b"onnx bytes" * 1000)
    info = store.adopt("alice", artifact)
    assert info.digest == "sha256:" + hashlib.sha256(artifact.read_bytes()).hexdigest()
    assert store.path("alice", info.digest).read_bytes() == artifact.read_bytes()


def test_clear_staging_removes_half_written_uploads(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    (store.root / ".staging" / "upload-crashed.part").write_bytes(b"half")
    BlobStore(tmp_path / "blobs").clear_staging()
    assert files_under(store.root) == []
