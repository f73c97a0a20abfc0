"""What a MosaicML Streaming index says, read as ``streaming.MDSWriter`` and ``merge_index``
write it: each shard's size, checked before any work (a shard cut or grown since fails naming
it); digests of known algorithms only; a plain tar of the folder (an upload) read in place as
the folder; a root index merged over parts read in its order, never above itself; an unsafe or
foreign index, or shards compressed differently, refused."""

from __future__ import annotations

import json
import tarfile

import numpy as np
import pytest
import torch

from bnrecal.errors import DatasetError
from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset
from bnrecal.workers.data.formats.mds_index import read_mds_index

from tests.workers.data.formats.mds_sets import TRANSFORM, changed_copy, read


def test_a_shard_cut_or_grown_since_its_index_was_written_is_refused_when_described(mds_written, tmp_path):
    for folder, shard, change in (("jpeg", "shard.00001.mds", -100), ("zstd", "shard.00000.mds.zstd", 7)):
        changed = changed_copy(mds_written[folder], tmp_path)
        data = (changed / shard).read_bytes()
        (changed / shard).write_bytes(data[:change] if change < 0 else data + b"\0" * change)
        with pytest.raises(DatasetError, match=rf"shard {shard} is corrupt: it is {len(data) + change} bytes, its "
                                               rf"index says {len(data)}"):
            describe_dataset(changed, ReadOptions(transform=TRANSFORM), DataAccess(unpack_root=tmp_path / "u"))


def test_a_digest_of_an_unknown_algorithm_is_refused(mds_written):
    index = json.loads((mds_written["hashed-raw"] / "index.json").read_text())
    index["shards"][0]["raw_data"]["hashes"] = {"crc7": "00"}
    with pytest.raises(DatasetError, match="lists a 'crc7' digest, which is not one Streaming writes"):
        read_mds_index(json.dumps(index).encode(), "index.json")


@pytest.mark.parametrize("top", [".", "photos"])
def test_an_mds_folder_packed_in_a_tar_reads_in_place_as_the_folder(mds_written, top, tmp_path):
    """As ``tar -C DIR -cf mds.tar .`` (or ``tar -cf mds.tar photos``) packs it, and as the server
    stores it when uploaded: by content, without its name."""
    packed = tmp_path / "mds.tar"
    with tarfile.open(packed, "w") as tar:
        tar.add(mds_written["zstd"], arcname=top)
    blob = tmp_path / "0f3a"
    blob.write_bytes(packed.read_bytes())
    _, expected, expected_labels = read(mds_written["folder"], tmp_path, order="shuffled", seed=3)
    for source in (packed, blob):
        spec, samples, labels = read(source, tmp_path, order="shuffled", seed=3)
        assert spec.summary().format == "mds" and all(ref.location == str(source) for ref in spec.shards.shards)
        assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)
    assert not (tmp_path / "u").exists() or not any((tmp_path / "u").iterdir())  # never unpacked


def test_an_mds_tar_that_cannot_be_read_in_place_is_refused_naming_it(mds_written, tmp_path):
    gzipped = tmp_path / "mds.tar.gz"
    with tarfile.open(gzipped, "w:gz") as tar:
        tar.add(mds_written["jpeg"], arcname=".")
    with pytest.raises(DatasetError, match=r"mds\.tar\.gz is a compressed tar of MDS shards.*plain \.tar"):
        read(gzipped, tmp_path)
    headless = tmp_path / "headless.tar"
    with tarfile.open(headless, "w") as tar:
        for shard in sorted(mds_written["jpeg"].glob("*.mds")):
            tar.add(shard, arcname=shard.name)
    with pytest.raises(DatasetError, match=r"headless\.tar holds MDS shards but no index\.json"):
        read(headless, tmp_path)


def test_a_root_index_merged_from_parts_reads_as_the_folder(mds_written, tmp_path):
    """Streaming's ``merge_index`` lists each part's shards as ``PART/shard.NNNNN.mds``."""
    index = json.loads((mds_written["merged"] / "index.json").read_text())
    assert {shard["raw_data"]["basename"].split("/")[0] for shard in index["shards"]} == {"0", "1"}
    _, samples, labels = read(mds_written["merged"], tmp_path, order="shuffled", seed=3)
    _, expected, expected_labels = read(mds_written["folder"], tmp_path, order="shuffled", seed=3)
    assert torch.equal(samples, expected) and np.array_equal(labels, expected_labels)
    escaping = changed_copy(mds_written["merged"], tmp_path)
    index["shards"][0]["raw_data"]["basename"] = "../0/shard.00000.mds"
    (escaping / "index.json").write_text(json.dumps(index))
    with pytest.raises(DatasetError, match=r"shard name '\.\./0/shard\.00000\.mds' is not a file below the index"):
        read(escaping, tmp_path)


def test_the_index_file_itself_names_the_same_data(mds_written, tmp_path):
    _, samples, _ = read(mds_written["jpeg"] / "index.json", tmp_path)
    _, expected, _ = read(mds_written["jpeg"], tmp_path)
    assert torch.equal(samples, expected)


def test_an_unsafe_or_foreign_index_is_not_read(mds_written, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    index = json.loads((mds_written["jpeg"] / "index.json").read_text())
    for shard in index["shards"]:
        shard["column_encodings"] = ["pkl", "int"]
    (pickled / "index.json").write_text(json.dumps(index))
    for part in mds_written["jpeg"].glob("*.mds"):
        pickled.joinpath(part.name).write_bytes(part.read_bytes())
    with pytest.raises(DatasetError, match="pickled.*never read"):
        read(pickled, tmp_path)


def test_shards_compressed_differently_are_refused(mds_written):
    index = json.loads((mds_written["zstd"] / "index.json").read_text())
    assert len(index["shards"]) >= 2
    index["shards"][1]["compression"] = "gz"
    with pytest.raises(DatasetError, match="compressed differently"):
        read_mds_index(json.dumps(index).encode(), "index.json")
