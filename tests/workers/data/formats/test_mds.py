"""MosaicML Streaming's MDS shards, written by ``streaming.MDSWriter`` itself: the same photos
as a folder read as the same samples and labels, whatever the image column's encoding
(the file's bytes, ``jpeg``, ``png``, raw ``pil`` pixels) or compression, locally and from S3,
where each rank fetches only its own samples with ranged GETs; a shard whose bytes changed
fails naming it (by its codec's CRC, or the digests its index lists); what cannot be read in
place fails before any work, naming the shard or the column. What the index says (sizes,
digests, a tar of the folder, a merged index) is ``test_mds_index.py``'s."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bnrecal.errors import DatasetError, DatasetOptionError
from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset
from bnrecal.workers.data.storage import reads as shard_reads
from bnrecal.workers.ranks.sharding import rank_ranges

from tests.s3 import S3Server
from tests.workers.data.formats.mds_sets import CODECS, ENCODINGS, TRANSFORM, changed_copy, read

BUCKET = "mds-data"


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_mds_shards_read_as_the_same_photos_in_a_folder(mds_written, encoding, tmp_path):
    assert len(list(mds_written[encoding].glob("shard.*.mds"))) >= 2
    spec, samples, labels = read(mds_written[encoding], tmp_path, order="shuffled", seed=3)
    _, expected, expected_labels = read(mds_written["folder"], tmp_path, order="shuffled", seed=3)
    summary = spec.summary()
    assert spec.kind == "shards" and summary.format == "mds" and summary.image_column == "image"
    assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)


@pytest.mark.parametrize("codec", CODECS)
def test_compressed_shards_read_as_the_same_photos_in_a_folder(mds_written, codec, tmp_path):
    assert len(list(mds_written[codec].glob(f"shard.*.mds.{codec}"))) >= 2 and not list(mds_written[codec].glob("*.mds"))
    spec, samples, labels = read(mds_written[codec], tmp_path, order="shuffled", seed=3)
    _, expected, expected_labels = read(mds_written["folder"], tmp_path, order="shuffled", seed=3)
    assert spec.summary().format == "mds"
    assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)


@pytest.mark.parametrize(("codec", "change"), [("gz", "flip"), ("bz2", "flip"), ("zstd", "cut"), ("gz", "cut")])
def test_a_compressed_shard_whose_bytes_changed_fails_naming_it(mds_written, codec, change, tmp_path):
    """gzip and bzip2 check their data (a CRC); Streaming's zstd frames carry no checksum, so
    of those only a shard cut short (or grown) is caught, as for a raw shard."""
    changed = tmp_path / "changed"
    changed.mkdir()
    for part in mds_written[codec].iterdir():
        changed.joinpath(part.name).write_bytes(part.read_bytes())
    shard = changed / f"shard.00001.mds.{codec}"
    data = bytearray(shard.read_bytes())
    if change == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[-40:]
    shard.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=rf"shard shard\.00001\.mds\.{codec} (is corrupt|holds|decompresses)"):
        read(changed, tmp_path)


@pytest.mark.parametrize(("folder", "shard"), [("hashed", "shard.00001.mds.zstd"), ("hashed-raw", "shard.00001.mds")])
def test_a_flipped_byte_fails_naming_the_shard_where_its_index_lists_digests(mds_written, folder, shard, tmp_path):
    """A flipped byte keeps the shard's size, and a zstd frame carries no checksum: the digests
    ``MDSWriter(hashes=...)`` lists catch it, in a compressed shard as it is read, in a raw one
    once it is read whole (for its labels)."""
    spec, samples, labels = read(mds_written[folder], tmp_path)  # intact: every digest checks
    _, expected, expected_labels = read(mds_written["folder"], tmp_path)
    assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)
    assert {a for s in spec.shards.listing.shards for a, _ in (s.packed or s.raw).hashes} == (
        {"sha1", "xxh64"} if folder == "hashed" else {"sha256"})
    changed = changed_copy(mds_written[folder], tmp_path)
    data = bytearray((changed / shard).read_bytes())
    data[len(data) // 2 if folder == "hashed" else -1] ^= 0xFF  # raw: the last label's top byte
    (changed / shard).write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=rf"shard {shard} is corrupt: its (sha1|xxh64|sha256) digest is not the one"):
        read(changed, tmp_path)


def test_columns_of_other_names_are_read_by_option(mds_written, tmp_path):
    _, samples, labels = read(mds_written["named"], tmp_path, image_column="photo", label_column="klass")
    _, expected, expected_labels = read(mds_written["folder"], tmp_path)
    assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)
    spec = describe_dataset(mds_written["named"], ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u"))
    with spec.open() as data:  # the only image column, found without the option
        assert torch.equal(data.load(0, len(data)), expected)


def test_what_cannot_be_read_in_place_fails_naming_the_shard_or_column(mds_written, tmp_path):
    with pytest.raises(DatasetError, match=r"shard shard\.00000\.mds is compressed with 'br', which is not read here"):
        read(mds_written["br"], tmp_path)
    with pytest.raises(DatasetOptionError, match="no label column 'label'.*set label_column") as refused:
        read(mds_written["unlabelled"], tmp_path)
    assert refused.value.field == "label_column"
    with pytest.raises(DatasetOptionError, match="no image column 'photo'.*image columns: image") as refused:
        read(mds_written["jpeg"], tmp_path, image_column="photo")
    assert refused.value.field == "image_column"
    broken = tmp_path / "broken"  # a shard cut short after the index was mds_written
    broken.mkdir()
    for part in mds_written["jpeg"].iterdir():
        broken.joinpath(part.name).write_bytes(part.read_bytes())
    shard = broken / "shard.00001.mds"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DatasetError, match="shard shard.00001.mds"):
        read(broken, tmp_path)


def test_mds_in_s3_reads_as_the_local_folder_each_rank_fetching_only_its_samples(
    s3_server: S3Server, mds_written, tmp_path, monkeypatch,
):
    s3_server.put_tree(BUCKET, "pil", mds_written["pil"])
    monkeypatch.setattr(shard_reads, "GATHER_GAP_BYTES", 0)  # one request per sample, to count them
    spec, samples, labels = read(f"s3://{BUCKET}/pil", tmp_path, s3_server.endpoint, order="shuffled", seed=5)
    _, expected, expected_labels = read(mds_written["folder"], tmp_path, order="shuffled", seed=5)
    assert spec.remote is not None and torch.equal(samples, expected) and np.array_equal(labels, expected_labels)

    ranges = rank_ranges(spec.num_samples, 4, 2, 1)  # rank 1 of 2
    before = len(s3_server.requests)
    with spec.open() as data:
        data.plan_reads(ranges)
        torch.cat([data.load(a, b) for a, b in ranges])
    gets = [r for r in s3_server.requests[before:] if r.method == "GET"]
    own = {int(row) for a, b in ranges for row in spec.sample_rows()[a:b]}
    shards = {r.path for r in gets}
    assert all(r.range is not None and "/shard." in r.path for r in gets)
    # each shard's offset table once, then one GET per own sample (adjacent ones merged), about half the bytes
    assert len(shards) < len(gets) <= len(own) + len(shards)
    assert sum(r.sent for r in gets) < 0.75 * sum(p.stat().st_size for p in mds_written["pil"].glob("*.mds"))


@pytest.mark.parametrize("folder", ["zstd", "merged"])
def test_compressed_or_merged_mds_in_s3_reads_as_the_local_folder(s3_server: S3Server, mds_written, folder, tmp_path):
    s3_server.put_tree(BUCKET, folder, mds_written[folder])
    spec, samples, labels = read(f"s3://{BUCKET}/{folder}", tmp_path, s3_server.endpoint, order="shuffled", seed=5)
    _, expected, expected_labels = read(mds_written["folder"], tmp_path, order="shuffled", seed=5)
    assert spec.remote is not None and torch.equal(samples, expected) and np.array_equal(labels, expected_labels)
