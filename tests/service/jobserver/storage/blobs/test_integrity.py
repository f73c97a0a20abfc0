"""Stored bytes checked against their digest: a blob damaged on disk (or in the bucket, moto)
is found when read, by the scrub, quarantined (``exists`` false, so ``HEAD`` answers 404)
and healed by the next upload of the right bytes; an artifact is moved into the store."""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bnrecal.service.jobserver.storage.blobs import BlobStore, FileBlobStore, S3BlobStore, open_blob_store, parse_blob_store
from bnrecal.service.jobserver.storage.scrub import BlobScrubber
from bnrecal.service.settings import Settings
from bnrecal.errors import CorruptBlobError


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def ingest(store: BlobStore, tenant: str, payload: bytes, filename: str | None = None):
    return asyncio.run(store.ingest(tenant, _chunks([payload]), 1 << 30, filename))


def flip(file: Path, offset: int = 100) -> None:
    """Flip one byte of a file in place, as a bad disk would (same size, same name)."""
    with open(file, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


class _Ledgerless:
    """What the scrub needs of a ledger on SQLite: an engine that is not Postgres."""

    class engine:  # noqa: N801 - stands in for a SQLAlchemy engine
        class dialect:  # noqa: N801
            name = "sqlite"


def scrubber(store: BlobStore, tmp_path: Path) -> BlobScrubber:
    return BlobScrubber(Settings(data_dir=tmp_path / "data", scrub_bytes_per_s=0), _Ledgerless(), store, None)  # type: ignore[arg-type]


def test_a_flipped_byte_is_found_when_read_and_the_blob_is_quarantined_then_healed(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    found: list[str] = []
    store.on_corrupt = found.append
    payload = os.urandom(300_000)
    info = ingest(store, "alice", payload, filename="calib.npy")
    assert store.check("alice", info.digest) == store.path("alice", info.digest)  # intact: read as it is
    flip(store.path("alice", info.digest))
    with pytest.raises(CorruptBlobError) as raised:
        store.check("alice", info.digest, field="data")
    message = str(raised.value)
    assert message.startswith("data: blob 'calib.npy' (" + info.digest + ") is corrupt") and "upload the file again" in message
    assert found == ["job"]
    assert not store.exists("alice", info.digest)  # HEAD answers 404: clients upload again
    assert len(store.quarantined()) == 1 and list(store.stored("alice")) == []
    healed = ingest(store, "alice", payload)
    assert healed.digest == info.digest and store.check("alice", info.digest).read_bytes() == payload


def test_an_upload_of_the_same_bytes_heals_damage_nobody_found_yet(tmp_path):
    """Before: a re-upload answered 201 and left the damaged file in place."""
    store = FileBlobStore(tmp_path / "blobs")
    payload = os.urandom(50_000)
    info = ingest(store, "alice", payload)
    flip(store.path("alice", info.digest))
    ingest(store, "alice", payload)
    assert store.path("alice", info.digest).read_bytes() == payload


def test_a_streamed_read_holds_back_its_last_chunk_and_is_cut_off_when_the_bytes_do_not_match(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    payload = os.urandom(5 * 65536 + 11)
    info = ingest(store, "alice", payload)
    with open(store.path("alice", info.digest), "rb") as handle:
        assert b"".join(store.verified_chunks("alice", info.digest, handle, 65536)) == payload
    flip(store.path("alice", info.digest), len(payload) - 3)  # in the last chunk
    got = []
    with open(store.path("alice", info.digest), "rb") as handle, pytest.raises(CorruptBlobError):
        for chunk in store.verified_chunks("alice", info.digest, handle, 65536):
            got.append(chunk)
    assert sum(map(len, got)) < len(payload)  # never all of it
    assert not store.exists("alice", info.digest)


def test_a_blob_replaced_by_good_bytes_while_it_was_read_is_not_quarantined(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    payload = os.urandom(10_000)
    info = ingest(store, "alice", payload)
    flip(store.path("alice", info.digest))
    with open(store.path("alice", info.digest), "rb") as damaged:
        ingest(store, "alice", payload)  # healed while the damaged file is being read
        with pytest.raises(CorruptBlobError):
            list(store.verified_chunks("alice", info.digest, damaged))
    assert store.path("alice", info.digest).read_bytes() == payload


def test_the_scrub_finds_every_damaged_blob_and_leaves_the_rest(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    blobs = [ingest(store, tenant, os.urandom(20_000)) for tenant in ("alice", "bob") for _ in range(3)]
    flip(store.path("bob", blobs[4].digest))
    report = scrubber(store, tmp_path).scrub()
    assert report.corrupt == [("bob", blobs[4].digest)] and report.blobs == 5 and report.bytes == 5 * 20_000
    assert [store.exists(t, b.digest) for t, b in zip(["alice"] * 3 + ["bob"] * 3, blobs)] == [True] * 4 + [False, True]


def test_an_artifact_is_moved_into_the_store_not_copied(tmp_path):
    store = FileBlobStore(tmp_path / "blobs")
    work = tmp_path / "work"
    work.mkdir()
    artifact = work / "recalibrated.pt"
    artifact.write_bytes(os.urandom(100_000))
    inode = artifact.stat().st_ino
    info = store.adopt("alice", artifact)
    stored = store.path("alice", info.digest)
    assert not artifact.exists() and stored.stat().st_ino == inode  # the same file, renamed
    assert info.digest == "sha256:" + hashlib.sha256(stored.read_bytes()).hexdigest()


# -- object storage (moto) ------------------------------------------------------------------


@pytest.fixture
def uri(s3_server) -> str:
    s3_server.bucket("blobs")
    return f"s3://blobs/integrity-{uuid.uuid4().hex[:8]}"


def overwrite_object(s3_server, uri: str, tenant: str, digest: str, body: bytes) -> None:
    """Damage the bucket's object of a blob: other bytes under its key (no checksum)."""
    bucket, prefix = parse_blob_store(uri)
    hex_digest = digest.removeprefix("sha256:")
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/{tenant}/sha256/{hex_digest[:2]}/{hex_digest}", Body=body)


def test_s3_a_damaged_object_is_found_on_fetch_quarantined_in_the_bucket_and_healed(uri, s3_server, tmp_path):
    writer = open_blob_store(uri, tmp_path / "a", s3_server.endpoint)
    reader = open_blob_store(uri, tmp_path / "b", s3_server.endpoint)
    assert isinstance(writer, S3BlobStore)
    payload = os.urandom(200_000)
    info = ingest(writer, "alice", payload, filename="model.pt")
    # S3 keeps our SHA-256 as its checksum; moto's server mode keeps none (the scrub then downloads)
    assert writer.object_checksum("alice", info.digest) in (None, info.digest)
    damaged = bytearray(payload)
    damaged[7] ^= 0xFF
    overwrite_object(s3_server, uri, "alice", info.digest, bytes(damaged))
    with pytest.raises(CorruptBlobError, match="in the object store"):
        reader.check("alice", info.digest, field="checkpoint")  # a replica without a cached copy fetches it
    assert not writer.exists("alice", info.digest) and not reader.exists("alice", info.digest)
    bucket, prefix = parse_blob_store(uri)
    listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/alice/quarantine/")
    assert len(listed.get("Contents", [])) == 1
    ingest(reader, "alice", payload)
    assert writer.check("alice", info.digest).read_bytes() == payload


def test_s3_a_damaged_cached_copy_is_fetched_again(uri, s3_server, tmp_path):
    store = open_blob_store(uri, tmp_path / "a", s3_server.endpoint)
    payload = os.urandom(100_000)
    info = ingest(store, "alice", payload)
    flip(store.path("alice", info.digest))  # the replica's cached copy, not the bucket's
    assert store.check("alice", info.digest).read_bytes() == payload
    assert store.exists("alice", info.digest)


def test_s3_the_scrub_compares_s3_checksums_and_hashes_objects_without_one(uri, s3_server, tmp_path):
    store = open_blob_store(uri, tmp_path / "a", s3_server.endpoint)
    good = ingest(store, "alice", os.urandom(30_000))
    bad = ingest(store, "alice", os.urandom(30_000))
    overwrite_object(s3_server, uri, "alice", bad.digest, b"not the bytes")
    (tmp_path / "a" / "alice").rename(tmp_path / "a" / "dropped")  # no cached copies: the bucket alone
    report = scrubber(store, tmp_path).scrub()
    assert report.corrupt == [("alice", bad.digest)]
    assert store.exists("alice", good.digest) and not store.exists("alice", bad.digest)

