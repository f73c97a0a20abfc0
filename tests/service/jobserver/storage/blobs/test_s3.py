"""The blob store in S3-compatible object storage (moto on loopback): content addressing,
the streamed cap, two replicas (two caches) seeing one bucket, deletion everywhere, last
use, and the storage collector and quotas working on it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bnrecal.service.jobserver.storage.blobs import BlobStore, FileBlobStore, S3BlobStore, open_blob_store, parse_blob_store
from bnrecal.service.jobserver.ledger import Ledger, sqlite_url
from bnrecal.service.jobserver.storage.collection import StorageCollector
from bnrecal.service.settings import Settings
from bnrecal.errors import NotFoundError, PayloadTooLargeError, SpecError


async def _chunks(parts: list[bytes], consumed: list[int]) -> AsyncIterator[bytes]:
    for part in parts:
        consumed.append(len(part))
        yield part


def ingest(store: BlobStore, tenant: str, parts: list[bytes], cap: int = 1 << 30, filename: str | None = None,
           consumed: list[int] | None = None):
    return asyncio.run(store.ingest(tenant, _chunks(parts, consumed if consumed is not None else []), cap, filename))


@pytest.fixture
def uri(s3_server) -> str:
    """A fresh prefix in the test bucket: a blob store of its own."""
    s3_server.bucket("blobs")
    return f"s3://blobs/store-{uuid.uuid4().hex[:8]}"


def replica(uri: str, root: Path, s3_server) -> S3BlobStore:
    """One replica's view of the store: the shared bucket, its own local cache."""
    store = open_blob_store(uri, root, s3_server.endpoint)
    assert isinstance(store, S3BlobStore) and not isinstance(store, FileBlobStore)  # side by side, not a subclass
    return store


def objects(s3_server, uri: str) -> dict[str, bytes]:
    bucket, prefix = parse_blob_store(uri)
    client = s3_server.client()
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {item["Key"][len(prefix) + 1:]: client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
            for item in listed}


def test_an_upload_streams_into_the_bucket_under_its_digest_and_other_replicas_read_it(uri, s3_server, tmp_path):
    a, b = replica(uri, tmp_path / "a", s3_server), replica(uri, tmp_path / "b", s3_server)
    payload = os.urandom(3 * 1024 * 1024 + 17)
    parts = [payload[i : i + 65536] for i in range(0, len(payload), 65536)]
    info = ingest(a, "alice", parts, filename="calib.npy")
    hex_digest = hashlib.sha256(payload).hexdigest()
    assert info.digest == "sha256:" + hex_digest and info.size == len(payload) and info.filename == "calib.npy"
    stored = objects(s3_server, uri)
    assert stored[f"alice/sha256/{hex_digest[:2]}/{hex_digest}"] == payload
    assert stored[f"alice/names/{hex_digest}"] == b"calib.npy"
    assert a.staging_files() == []
    # replica b has nothing cached: it fetches the object once and serves its copy
    assert not (tmp_path / "b" / "alice").exists()
    assert b.path("alice", info.digest).read_bytes() == payload
    assert b.info("alice", info.digest) == info and b.exists("alice", info.digest)
    assert not b.exists("bob", info.digest)
    with pytest.raises(NotFoundError):
        b.path("bob", info.digest)
    assert ingest(b, "alice", [payload]).digest == info.digest  # the same bytes: the same object
    assert len([key for key in objects(s3_server, uri) if "/sha256/" in key]) == 1


def test_the_cap_stops_the_stream_and_leaves_nothing_in_the_bucket(uri, s3_server, tmp_path):
    store = replica(uri, tmp_path / "a", s3_server)
    consumed: list[int] = []
    with pytest.raises(PayloadTooLargeError, match="BNRECAL_MAX_UPLOAD_BYTES"):
        ingest(store, "alice", [b"x" * 1000] * 50, cap=4500, consumed=consumed)
    assert sum(consumed) == 5000
    assert objects(s3_server, uri) == {} and store.staging_files() == []


def test_a_blob_deleted_on_one_replica_is_gone_on_every_replica(uri, s3_server, tmp_path):
    a, b = replica(uri, tmp_path / "a", s3_server), replica(uri, tmp_path / "b", s3_server)
    digest = ingest(a, "alice", [b"weights" * 100], filename="w.pt").digest
    cached = b.path("alice", digest)
    assert b.remove("alice", digest) == 700
    assert objects(s3_server, uri) == {} and not cached.exists()
    with pytest.raises(NotFoundError):
        a.path("alice", digest)  # a's cached copy is not served once the object is gone
    assert not any((tmp_path / "a").rglob(digest.removeprefix("sha256:")))
    assert a.remove("alice", digest) == 0


def test_listing_last_use_and_touch(uri, s3_server, tmp_path):
    store = replica(uri, tmp_path / "a", s3_server)
    first = ingest(store, "alice", [b"one"]).digest
    second = ingest(store, "bob", [b"two!"]).digest
    assert store.tenants() == ["alice", "bob"]
    listed = {blob.digest: blob for blob in store.stored("alice")}
    assert list(listed) == [first] and listed[first].size == 3
    stored_at = store.last_used("alice", first)
    assert abs(stored_at - time.time()) < 120
    time.sleep(1.1)  # S3 times have a resolution of one second
    store.touch("alice", first)
    assert store.last_used("alice", first) > stored_at
    assert {b.digest: b for b in store.stored("alice")}[first].last_used == store.last_used("alice", first)
    assert [blob.digest for blob in store.stored("bob")] == [second]


def test_the_collector_and_quota_usage_work_on_the_bucket(uri, s3_server, tmp_path):
    settings = Settings(data_dir=tmp_path, blob_retention_s=60.0, blob_store=uri, s3_endpoint_url=s3_server.endpoint)
    ledger = Ledger(sqlite_url(tmp_path))
    try:
        store = replica(uri, tmp_path / "blobs", s3_server)
        used = ingest(store, "alice", [b"checkpoint" * 10]).digest
        unused = ingest(store, "alice", [b"orphan" * 10]).digest
        ledger.create("alice", {"arch": "tests.nets:mixed_net", "checkpoint": used, "data": used})
        collector = StorageCollector(settings, ledger, store)
        assert collector.usage("alice") == 160
        assert collector.collect().removals == []  # everything is younger than the retention
        report = collector.collect(now=time.time() + 3600)
        assert [(removal.kind, removal.name) for removal in report.removals] == [("blob", unused)]
        assert store.exists("alice", used) and not store.exists("alice", unused)
        assert collector.usage("alice") == 100
    finally:
        ledger.close()


def test_a_blob_store_uri_names_a_bucket(s3_server, tmp_path):
    assert parse_blob_store("s3://bucket/some/prefix/") == ("bucket", "some/prefix")
    assert isinstance(open_blob_store(None, tmp_path), FileBlobStore)
    for bad in ("gs://bucket/x", "s3:///x", "/srv/blobs"):
        with pytest.raises(SpecError, match="BNRECAL_BLOB_STORE"):
            parse_blob_store(bad)
    with pytest.raises(SpecError, match="BNRECAL_BLOB_STORE: bucket 'no-such-bucket'"):
        open_blob_store("s3://no-such-bucket/x", tmp_path, s3_server.endpoint)
