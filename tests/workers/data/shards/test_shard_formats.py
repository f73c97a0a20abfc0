"""The formats of shards as their modules declare them (``workers.data.shards.shard_formats``):
each entry counts and opens the shards written by the ecosystem's writers as the described
dataset does, says truly whether its samples sit in columns, and a name no entry has is
refused where the shards are made, not in a rank."""

from __future__ import annotations

import numpy as np
import pytest

from bnrecal.errors import DatasetOptionError
from bnrecal.workers.data import SHARD_FORMATS, DataAccess, ReadOptions, columned, describe_dataset, shard_format
from bnrecal.workers.data.opened import ShardSource
from bnrecal.workers.data.shards.dataset import ShardSet

from tests.shards import folder_order, photos, write_parquet, write_save_to_disk, write_tar_shards


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("shard-formats")
    ordered = folder_order(photos(30, size=16))
    write_tar_shards(root / "webdataset", ordered, 12)
    write_parquet(root / "parquet", ordered, 20, row_group=7)
    write_save_to_disk(root / "arrow", ordered, batch=9)
    return {name: root / name for name in ("webdataset", "parquet", "arrow")}


@pytest.mark.parametrize("name", ["webdataset", "parquet", "arrow"])
def test_each_entry_counts_and_opens_the_shards_it_is_named_for(written, name, tmp_path):
    spec = describe_dataset(written[name], ReadOptions(transform={"resize": 16, "crop": 16}),
                            DataAccess(unpack_root=tmp_path))
    shards = spec.shards
    assert shards.kind is shard_format(name) and spec.summary().format == name
    for position, ref in enumerate(shards.shards):
        source = ShardSource(ref, position, "calibration data", image_column=shards.image_column)
        counted = shard_format(name).count(source)
        assert counted.rows == shards.counts[position] and counted.groups == shards.groups[position]
        reader = shards.reader(position)
        try:
            rows = list(range(counted.rows))
            found = reader.read(rows)
            assert len(found) == counted.rows and all(data[:2] == b"\xff\xd8" for _, data in found)  # JPEGs, whole
            assert reader.encoded_bytes(np.arange(counted.rows)) >= (
                sum(len(data) for _, data in found) if name == "webdataset" else counted.rows)
        finally:
            reader.close()


@pytest.mark.parametrize("name", ["webdataset", "parquet"])
def test_a_column_option_is_taken_exactly_where_the_format_has_columns(written, name, tmp_path):
    options = ReadOptions(transform={"resize": 16, "crop": 16}, image_column="image")
    if shard_format(name).columns:
        assert describe_dataset(written[name], options, DataAccess(unpack_root=tmp_path)).shards.image_column == "image"
    else:
        with pytest.raises(DatasetOptionError, match=f"apply to {columned('and')} data, not tar shards"):
            describe_dataset(written[name], options, DataAccess(unpack_root=tmp_path))


def test_the_formats_are_named_once_and_an_unknown_name_is_refused_where_the_shards_are_made():
    assert [f.name for f in SHARD_FORMATS] == ["webdataset", "parquet", "arrow", "mds"]
    assert columned("or") == "Parquet, Arrow or MDS"
    with pytest.raises(ValueError, match="no format of shards is named 'lance'"):
        ShardSet(format="lance", shards=(), counts=())


def test_each_format_finds_its_own_shards_and_leaves_every_other_source_alone(written, tmp_path):
    """A format's ``find`` is the whole of its detection: each takes the file or folder its
    writer made (a WebDataset tar, a Parquet file, a ``save_to_disk`` folder), naming its
    shards as the described dataset does, and returns None for every other format's and for a
    plain image folder (which goes its old way)."""
    from bnrecal.workers.data.shards.detection import LocalCandidate

    from tests.shards import write_folder

    sources = {
        "webdataset": sorted(written["webdataset"].glob("*.tar"))[0],
        "parquet": sorted(written["parquet"].rglob("*.parquet"))[0],
        "arrow": written["arrow"],
        None: write_folder(tmp_path / "photos", photos(3, size=16)),
    }
    for owner, source in sources.items():
        candidate = LocalCandidate(source, source.name, "calibration data", None, tmp_path)
        for each in SHARD_FORMATS:
            found = each.find(candidate)
            if each.name != owner:
                assert found is None, f"{each.name} took {owner}'s {source.name}"
                continue
            assert found is not None and found.format == owner
            described = describe_dataset(source, ReadOptions(transform={"resize": 16, "crop": 16}),
                                         DataAccess(unpack_root=tmp_path))
            assert found.refs == list(described.shards.shards) and len(found.refs) == 1
