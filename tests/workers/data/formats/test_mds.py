"""MosaicML Streaming's MDS shards, written by ``streaming.MDSWriter`` itself: the same photos
as a folder read as the same samples and labels, whatever the image column's encoding
(the file's bytes, ``jpeg``, ``png``, raw ``pil`` pixels), locally and from S3, where each
rank fetches only its own samples with ranged GETs, packed in a tar (an upload) or under an
index merged from several parts; what cannot be read in place, and a shard that changed
since its index was written, fails naming the shard or the column."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from bnrecal.errors import DatasetError, DatasetOptionError
from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset, read_labels
from bnrecal.workers.data.storage import reads as shard_reads
from bnrecal.workers.ranks.sharding import rank_ranges

from tests.s3 import S3Server
from tests.shards import folder_order, photos, write_folder
from tests.streaming_writer import MdsSet, write_mds

TRANSFORM = {"resize": 24, "crop": 24}
BUCKET = "mds-data"
ENCODINGS = ("bytes", "jpeg", "png", "pil")
CODECS = ("zstd", "gz", "bz2")  # Streaming's compressions read here


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mds")
    items = photos(40, size=32)
    ordered = folder_order(items)
    write_folder(root / "folder", items)
    sets = [MdsSet(root / encoding, ordered, encoding, size_limit=12_000) for encoding in ENCODINGS]  # several shards
    sets += [MdsSet(root / "unlabelled", ordered[:8], "jpeg", labels=False),
             *(MdsSet(root / codec, ordered, "jpeg", size_limit=12_000, compression=codec) for codec in CODECS),
             MdsSet(root / "br", ordered[:8], "jpeg", compression="br"),
             MdsSet(root / "named", ordered, "png", image_name="photo", label_name="klass"),
             MdsSet(root / "hashed", ordered, "jpeg", size_limit=12_000, compression="zstd", hashes=("sha1", "xxh64")),
             MdsSet(root / "hashed-raw", ordered, "jpeg", size_limit=12_000, hashes=("sha256",)),
             MdsSet(root / "merged", ordered, "jpeg", size_limit=12_000, parts=2)]
    write_mds(*sets)
    return {"folder": root / "folder"} | {one.folder.name: one.folder for one in sets}


def read(source: Path | str, tmp_path: Path, endpoint: str | None = None, **options: object):
    spec = describe_dataset(source, ReadOptions(transform=TRANSFORM, **options),
                            DataAccess(unpack_root=tmp_path / "u", endpoint_url=endpoint))
    with spec.open() as data:
        return spec, data.load(0, len(data)), read_labels(spec)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_mds_shards_read_as_the_same_photos_in_a_folder(written, encoding, tmp_path):
    assert len(list(written[encoding].glob("shard.*.mds"))) >= 2
    spec, samples, labels = read(written[encoding], tmp_path, order="shuffled", seed=3)
    _, expected, expected_labels = read(written["folder"], tmp_path, order="shuffled", seed=3)
    summary = spec.summary()
    assert spec.kind == "shards" and summary.format == "mds" and summary.image_column == "image"
    assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)


@pytest.mark.parametrize("codec", CODECS)
def test_compressed_shards_read_as_the_same_photos_in_a_folder(written, codec, tmp_path):
    assert len(list(written[codec].glob(f"shard.*.mds.{codec}"))) >= 2 and not list(written[codec].glob("*.mds"))
    spec, samples, labels = read(written[codec], tmp_path, order="shuffled", seed=3)
    _, expected, expected_labels = read(written["folder"], tmp_path, order="shuffled", seed=3)
    assert spec.summary().format == "mds"
    assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)


@pytest.mark.parametrize(("codec", "change"), [("gz", "flip"), ("bz2", "flip"), ("zstd", "cut"), ("gz", "cut")])
def test_a_compressed_shard_whose_bytes_changed_fails_naming_it(written, codec, change, tmp_path):
    """gzip and bzip2 check their data (a CRC); Streaming's zstd frames carry no checksum, so
    of those only a shard cut short (or grown) is caught, as for a raw shard."""
    changed = tmp_path / "changed"
    changed.mkdir()
    for part in written[codec].iterdir():
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


def changed_copy(folder: Path, tmp_path: Path) -> Path:
    """A copy of an MDS folder, to change."""
    return Path(shutil.copytree(folder, tmp_path / f"{folder.name}-changed"))


def test_a_shard_cut_or_grown_since_its_index_was_written_is_refused_when_described(written, tmp_path):
    for folder, shard, change in (("jpeg", "shard.00001.mds", -100), ("zstd", "shard.00000.mds.zstd", 7)):
        changed = changed_copy(written[folder], tmp_path)
        data = (changed / shard).read_bytes()
        (changed / shard).write_bytes(data[:change] if change < 0 else data + b"\0" * change)
        with pytest.raises(DatasetError, match=rf"shard {shard} is corrupt: it is {len(data) + change} bytes, its "
                                               rf"index says {len(data)}"):
            describe_dataset(changed, ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u"))


@pytest.mark.parametrize(("folder", "shard"), [("hashed", "shard.00001.mds.zstd"), ("hashed-raw", "shard.00001.mds")])
def test_a_flipped_byte_fails_naming_the_shard_where_its_index_lists_digests(written, folder, shard, tmp_path):
    """A flipped byte keeps the shard's size, and a zstd frame carries no checksum: the digests
    ``MDSWriter(hashes=...)`` lists catch it, in a compressed shard as it is read, in a raw one
    once it is read whole (for its labels)."""
    spec, samples, labels = read(written[folder], tmp_path)  # intact: every digest checks
    _, expected, expected_labels = read(written["folder"], tmp_path)
    assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)
    assert {a for s in spec.shards.mds.shards for a, _ in (s.packed or s.raw).hashes} == (
        {"sha1", "xxh64"} if folder == "hashed" else {"sha256"})
    changed = changed_copy(written[folder], tmp_path)
    data = bytearray((changed / shard).read_bytes())
    data[len(data) // 2 if folder == "hashed" else -1] ^= 0xFF  # raw: the last label's top byte
    (changed / shard).write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=rf"shard {shard} is corrupt: its (sha1|xxh64|sha256) digest is not the one"):
        read(changed, tmp_path)


def test_a_digest_of_an_unknown_algorithm_is_refused(written):
    from bnrecal.workers.data.formats.mds import read_mds_index

    index = json.loads((written["hashed-raw"] / "index.json").read_text())
    index["shards"][0]["raw_data"]["hashes"] = {"crc7": "00"}
    with pytest.raises(DatasetError, match="lists a 'crc7' digest, which is not one Streaming writes"):
        read_mds_index(json.dumps(index).encode(), "index.json")


@pytest.mark.parametrize("top", [".", "photos"])
def test_an_mds_folder_packed_in_a_tar_reads_in_place_as_the_folder(written, top, tmp_path):
    """As ``tar -C DIR -cf mds.tar .`` (or ``tar -cf mds.tar photos``) packs it, and as the server
    stores it when uploaded: by content, without its name."""
    packed = tmp_path / "mds.tar"
    with tarfile.open(packed, "w") as tar:
        tar.add(written["zstd"], arcname=top)
    blob = tmp_path / "0f3a"
    blob.write_bytes(packed.read_bytes())
    _, expected, expected_labels = read(written["folder"], tmp_path, order="shuffled", seed=3)
    for source in (packed, blob):
        spec, samples, labels = read(source, tmp_path, order="shuffled", seed=3)
        assert spec.summary().format == "mds" and all(ref.location == str(source) for ref in spec.shards.shards)
        assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)
    assert not (tmp_path / "u").exists() or not any((tmp_path / "u").iterdir())  # never unpacked


def test_an_mds_tar_that_cannot_be_read_in_place_is_refused_naming_it(written, tmp_path):
    gzipped = tmp_path / "mds.tar.gz"
    with tarfile.open(gzipped, "w:gz") as tar:
        tar.add(written["jpeg"], arcname=".")
    with pytest.raises(DatasetError, match=r"mds\.tar\.gz is a compressed tar of MDS shards.*plain \.tar"):
        read(gzipped, tmp_path)
    headless = tmp_path / "headless.tar"
    with tarfile.open(headless, "w") as tar:
        for shard in sorted(written["jpeg"].glob("*.mds")):
            tar.add(shard, arcname=shard.name)
    with pytest.raises(DatasetError, match=r"headless\.tar holds MDS shards but no index\.json"):
        read(headless, tmp_path)


def test_a_root_index_merged_from_parts_reads_as_the_folder(written, tmp_path):
    """Streaming's ``merge_index`` lists each part's shards as ``PART/shard.NNNNN.mds``."""
    index = json.loads((written["merged"] / "index.json").read_text())
    assert {shard["raw_data"]["basename"].split("/")[0] for shard in index["shards"]} == {"0", "1"}
    _, samples, labels = read(written["merged"], tmp_path, order="shuffled", seed=3)
    _, expected, expected_labels = read(written["folder"], tmp_path, order="shuffled", seed=3)
    assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)
    escaping = changed_copy(written["merged"], tmp_path)
    index["shards"][0]["raw_data"]["basename"] = "../0/shard.00000.mds"
    (escaping / "index.json").write_text(json.dumps(index))
    with pytest.raises(DatasetError, match=r"shard name '\.\./0/shard\.00000\.mds' is not a file below the index"):
        read(escaping, tmp_path)


def test_the_index_file_itself_names_the_same_data(written, tmp_path):
    _, samples, _ = read(written["jpeg"] / "index.json", tmp_path)
    _, expected, _ = read(written["jpeg"], tmp_path)
    assert torch.equal(samples, expected)


def test_columns_of_other_names_are_read_by_option(written, tmp_path):
    _, samples, labels = read(written["named"], tmp_path, image_column="photo", label_column="klass")
    _, expected, expected_labels = read(written["folder"], tmp_path)
    assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)
    spec = describe_dataset(written["named"], ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u"))
    with spec.open() as data:  # the only image column, found without the option
        assert torch.equal(data.load(0, len(data)), expected)


def test_what_cannot_be_read_in_place_fails_naming_the_shard_or_column(written, tmp_path):
    with pytest.raises(DatasetError, match=r"shard shard\.00000\.mds is compressed with 'br', which is not read here"):
        read(written["br"], tmp_path)
    with pytest.raises(DatasetOptionError, match="no label column 'label'.*set label_column") as refused:
        read(written["unlabelled"], tmp_path)
    assert refused.value.field == "label_column"
    with pytest.raises(DatasetOptionError, match="no image column 'photo'.*image columns: image") as refused:
        read(written["jpeg"], tmp_path, image_column="photo")
    assert refused.value.field == "image_column"
    broken = tmp_path / "broken"  # a shard cut short after the index was written
    broken.mkdir()
    for part in written["jpeg"].iterdir():
        broken.joinpath(part.name).write_bytes(part.read_bytes())
    shard = broken / "shard.00001.mds"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DatasetError, match="shard shard.00001.mds"):
        read(broken, tmp_path)


def test_an_unsafe_or_foreign_index_is_not_read(written, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    index = json.loads((written["jpeg"] / "index.json").read_text())
    for shard in index["shards"]:
        shard["column_encodings"] = ["pkl", "int"]
    (pickled / "index.json").write_text(json.dumps(index))
    for part in written["jpeg"].glob("*.mds"):
        pickled.joinpath(part.name).write_bytes(part.read_bytes())
    with pytest.raises(DatasetError, match="pickled.*never read"):
        read(pickled, tmp_path)


def test_mds_in_s3_reads_as_the_local_folder_each_rank_fetching_only_its_samples(
    s3_server: S3Server, written, tmp_path, monkeypatch,
):
    s3_server.put_tree(BUCKET, "pil", written["pil"])
    monkeypatch.setattr(shard_reads, "GATHER_GAP_BYTES", 0)  # one request per sample, to count them
    spec, samples, labels = read(f"s3://{BUCKET}/pil", tmp_path, s3_server.endpoint, order="shuffled", seed=5)
    _, expected, expected_labels = read(written["folder"], tmp_path, order="shuffled", seed=5)
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
    assert sum(r.sent for r in gets) < 0.75 * sum(p.stat().st_size for p in written["pil"].glob("*.mds"))


@pytest.mark.parametrize("folder", ["zstd", "merged"])
def test_compressed_or_merged_mds_in_s3_reads_as_the_local_folder(s3_server: S3Server, written, folder, tmp_path):
    s3_server.put_tree(BUCKET, folder, written[folder])
    spec, samples, labels = read(f"s3://{BUCKET}/{folder}", tmp_path, s3_server.endpoint, order="shuffled", seed=5)
    _, expected, expected_labels = read(written["folder"], tmp_path, order="shuffled", seed=5)
    assert spec.remote is not None and torch.equal(samples, expected) and np.array_equal(labels, expected_labels)


def test_shards_compressed_differently_are_refused(written):
    from bnrecal.workers.data.formats.mds import read_mds_index

    index = json.loads((written["zstd"] / "index.json").read_text())
    assert len(index["shards"]) >= 2
    index["shards"][1]["compression"] = "gz"
    with pytest.raises(DatasetError, match="compressed differently"):
        read_mds_index(json.dumps(index).encode(), "index.json")
