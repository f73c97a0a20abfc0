"""Shards in object storage, through a local moto S3 server that records every request:
the same samples as the local folder, each rank fetching its own members with ranged GETs,
Parquet row groups read by range, a prefix listed once and the listing cached."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset, read_labels
from bnrecal.workers.data.storage import reads as shard_reads
from bnrecal.workers.data.storage.objectstore import RemoteSource
from bnrecal.workers.data.shards.listing import LIST_THREADS, list_prefix, prefix_shards, refs_of
from bnrecal.errors import DatasetError
from bnrecal.workers.ranks.sharding import rank_ranges

from tests.ecosystem import save_dataset, save_dataset_dict
from tests.s3 import S3Server
from tests.shards import folder_order, photos, write_folder, write_parquet, write_tar_shards

BUCKET = "shard-data"
TRANSFORM = {"resize": 24, "crop": 24}


@pytest.fixture(scope="module")
def uploaded(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("s3shards")
    items = photos(90, size=48)
    ordered = folder_order(items)
    write_folder(root / "folder", items)
    tars = write_tar_shards(root / "wds", ordered, 30)
    gz = write_tar_shards(root / "gz", ordered, 30, gz=True)
    parquet = write_parquet(root / "pq", ordered, 90, row_group=10)
    s3_server.put_tree(BUCKET, "wds", root / "wds")
    s3_server.put_tree(BUCKET, "gz", root / "gz")
    s3_server.put_tree(BUCKET, "hf", root / "pq")
    s3_server.put(BUCKET, "lists/gz.manifest", "\n".join(f"s3://{BUCKET}/gz/{p.name}" for p in gz).encode())
    return {"root": root, "tars": tars, "parquet": parquet[0], "folder": root / "folder"}


def local(uploaded: dict[str, object], tmp_path: Path, **options: object) -> tuple[torch.Tensor, np.ndarray]:
    spec = describe_dataset(
        uploaded["folder"], ReadOptions(transform=TRANSFORM, **options), DataAccess(unpack_root=tmp_path / "u"),
    )
    with spec.open() as data:
        return data.load(0, len(data)), read_labels(spec)


@pytest.mark.parametrize("source", ["wds", "wds/train-{000000..000002}.tar", "lists/gz.manifest", "hf"])
def test_shards_in_s3_read_as_the_local_folder(s3_server, uploaded, source, tmp_path):
    spec = describe_dataset(
        f"s3://{BUCKET}/{source}", ReadOptions(transform=TRANSFORM, order="shuffled", seed=2),
        DataAccess(unpack_root=tmp_path / "u", endpoint_url=s3_server.endpoint),
    )
    assert spec.kind == "shards" and spec.remote is not None and spec.num_samples == 90
    with spec.open() as data:
        found = data.load(0, 90)
    expected, labels = local(uploaded, tmp_path, order="shuffled", seed=2)
    assert torch.equal(found, expected) and np.array_equal(read_labels(spec), labels)


def test_a_saved_dataset_in_s3_reads_as_the_same_folder_on_disk(s3_server, tmp_path):
    pytest.importorskip("datasets")
    items = photos(30, size=32)
    saved = save_dataset(tmp_path / "saved", items, num_shards=2)
    uri = s3_server.put_tree(BUCKET, "saved", saved)
    read = ReadOptions(transform=TRANSFORM, order="shuffled", seed=3)
    local = describe_dataset(saved, read, DataAccess(unpack_root=tmp_path / "u"))
    spec = describe_dataset(uri, read, DataAccess(unpack_root=tmp_path / "u", endpoint_url=s3_server.endpoint))
    assert spec.shards.format == "arrow" and len(spec.shards.shards) == 2 and spec.remote is not None
    with spec.open() as data, local.open() as expected:
        assert torch.equal(data.load(0, 30), expected.load(0, 30))
    assert np.array_equal(read_labels(spec), read_labels(local))


def test_a_saved_dataset_dict_in_s3_is_refused_naming_a_split_to_give(s3_server, tmp_path):
    pytest.importorskip("datasets")
    items = photos(6, size=32)
    uri = s3_server.put_tree(BUCKET, "dict", save_dataset_dict(tmp_path / "d", {"train": items[:4], "test": items[4:]}))
    read, access = ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u", endpoint_url=s3_server.endpoint)
    with pytest.raises(DatasetError) as refused:
        describe_dataset(uri, read, access)
    assert str(refused.value) == (
        f"{uri} holds a DatasetDict with splits train, test, not one dataset: give one split's folder as the "
        f"calibration data, e.g. {uri}/train"
    )
    assert describe_dataset(f"{uri}/train", read, access).num_samples == 4


def test_a_glob_in_s3_says_globs_are_not_expanded_and_what_to_give(s3_server, uploaded, tmp_path):
    uri = f"s3://{BUCKET}/wds/train-*.tar"
    with pytest.raises(DatasetError) as refused:
        describe_dataset(uri, access=DataAccess(unpack_root=tmp_path / "u", endpoint_url=s3_server.endpoint))
    assert str(refused.value) == (
        f"calibration data not found: {uri}; globs (*, ?, [...]) are not expanded: name the shards with a brace "
        "pattern such as 'train-{000000..000146}.tar' ({000..146} ranges keep the zero padding, {a,b} lists), "
        "or give their prefix"
    )


def test_each_rank_fetches_only_its_members_with_ranged_gets(s3_server, uploaded, tmp_path, monkeypatch):
    monkeypatch.setattr(shard_reads, "GATHER_GAP_BYTES", 0)  # one request per member, to count them
    spec = describe_dataset(
        f"s3://{BUCKET}/wds", ReadOptions(transform=TRANSFORM, order="shuffled", seed=4),
        DataAccess(unpack_root=tmp_path / "u", endpoint_url=s3_server.endpoint),
    )
    ranges = rank_ranges(spec.num_samples, 8, 3, 1)  # rank 1 of 3: about a third of the 90 samples
    before = len(s3_server.requests)
    with spec.open() as data:
        data.plan_reads(ranges)
        rank = torch.cat([data.load(a, b) for a, b in ranges])
    gets = [r for r in s3_server.requests[before:] if r.method == "GET"]
    own = sorted({int(row) for a, b in ranges for row in spec.sample_rows()[a:b]})
    assert len(rank) == len(own) and 25 <= len(own) <= 35
    assert all(r.range is not None and r.path.startswith(f"/{BUCKET}/wds/train-") for r in gets)
    assert len(gets) == len(own)  # one ranged GET per own member (its 512-byte header and its bytes), no listing
    shard_bytes = sum(p.stat().st_size for p in uploaded["tars"])
    assert sum(r.sent for r in gets) < shard_bytes / 2


def test_parquet_in_s3_reads_only_the_row_groups_it_needs(s3_server, uploaded, tmp_path):
    key = f"/{BUCKET}/hf/data/{uploaded['parquet'].name}"
    spec = describe_dataset(
        f"s3:/{key}", ReadOptions(transform=TRANSFORM, order="given"),
        DataAccess(unpack_root=tmp_path / "u", endpoint_url=s3_server.endpoint),
    )
    before = len(s3_server.gets(key))
    with spec.open() as data:
        data.load(20, 30)  # one row group of 10 rows, of 9
    fetched = s3_server.gets(key)[before:]
    assert fetched and all(r.range is not None for r in fetched)
    size = uploaded["parquet"].stat().st_size
    footer = [r for r in fetched if r.range.endswith(f"-{size - 1}")]  # pyarrow reads the footer's last 64 KiB
    chunks = [r for r in fetched if r not in footer]
    assert len(footer) == 1 and len(chunks) == 1  # then one column chunk: the image column of row group 2
    assert chunks[0].sent < size / 8


def test_a_prefix_is_listed_once_in_concurrent_ranges_and_the_listing_cached(s3_server, tmp_path):
    client = s3_server.client()
    s3_server.bucket(BUCKET)
    for folder, count in (("a", 2300), ("b", 150)):
        for i in range(count):
            client.put_object(Bucket=BUCKET, Key=f"many/{folder}/part-{i:06d}.tar", Body=b"")
    source = RemoteSource(f"s3://{BUCKET}/many", s3_server.endpoint)

    def lists() -> int:
        return sum(1 for r in s3_server.requests if r.method == "GET" and r.path.rstrip("/") == f"/{BUCKET}")

    before = lists()
    objects = list_prefix(source, "calibration data", tmp_path)
    assert len(objects) == 2450  # every key once: the first page, then 15 key ranges listed concurrently
    assert lists() - before <= 1 + 2 * LIST_THREADS  # a range may read one page past its end
    refs = prefix_shards(source, objects)
    assert [r.name for r in refs[:2]] == ["a/part-000000.tar", "a/part-000001.tar"] and refs[-1].name == "b/part-000149.tar"
    assert len({r.name for r in refs}) == 2450 and [r.name for r in refs] == sorted(r.name for r in refs)
    again = lists()
    assert list_prefix(source, "calibration data", tmp_path) == objects and lists() == again  # from the cache


def test_a_long_brace_pattern_lists_its_folder_instead_of_a_head_per_shard(s3_server, tmp_path):
    client = s3_server.client()
    s3_server.bucket(BUCKET)
    for i in range(40):
        client.put_object(Bucket=BUCKET, Key=f"pattern/part-{i:03d}.tar", Body=b"x" * i)
    before = len(s3_server.requests)
    refs = refs_of([f"s3://{BUCKET}/pattern/part-{{000..039}}.tar"], "calibration data", s3_server.endpoint, tmp_path)
    asked = s3_server.requests[before:]
    assert [r.size for r in refs] == list(range(40)) and refs[7].name == "part-007.tar"
    assert not [r for r in asked if r.method == "HEAD"] and len(asked) <= 2  # one listing, no HEAD per shard
    client.put_object(Bucket=BUCKET, Key="pattern/part-040.tar", Body=b"new")  # after the cached listing
    refs = refs_of([f"s3://{BUCKET}/pattern/part-{{000..040}}.tar"], "calibration data", s3_server.endpoint, tmp_path)
    assert refs[-1].size == 3  # not in the cached listing: listed afresh
    with pytest.raises(DatasetError, match=r"shard s3://shard-data/pattern/part-041.tar not found"):
        refs_of([f"s3://{BUCKET}/pattern/part-{{000..041}}.tar"], "calibration data", s3_server.endpoint, tmp_path)
