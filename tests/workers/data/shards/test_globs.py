"""A glob given as data (``train-*.parquet``) is not expanded: the "not found" error says so and
gives the brace pattern that names the same shards (docs/data.md, "WebDataset"), which then reads."""

from __future__ import annotations

import pytest

from bnrecal.errors import DatasetError
from bnrecal.workers.data import DataAccess, describe_dataset
from bnrecal.workers.data.shards.patterns import brace_pattern, glob_hint

from tests.shards import photos, write_folder, write_parquet


@pytest.mark.parametrize(("names", "pattern"), [
    (["d/train-00000-of-00003.parquet", "d/train-00001-of-00003.parquet", "d/train-00002-of-00003.parquet"],
     "d/train-{00000..00002}-of-00003.parquet"),
    (["shard-9.tar", "shard-10.tar", "shard-11.tar"], "shard-{9..11}.tar"),  # unpadded numbers
    (["d/a-000001.tar", "d/a-000003.tar"], "d/a-{000001,000003}.tar"),  # a gap: a list
    (["d/test.parquet", "d/train.parquet"], "d/{test,train}.parquet"),
    (["d/a.jpg", "d/b.jpg"], None),  # images are not shards: no pattern names them
    (["d/a.tar", "e/b.tar"], None),  # two folders
])
def test_the_brace_pattern_names_exactly_the_matches(names, pattern):
    assert brace_pattern(names) == pattern


def test_a_glob_of_shards_names_the_brace_pattern_of_its_matches(tmp_path):
    items = photos(9, size=32)
    write_parquet(tmp_path, items, 3)
    glob = f"{tmp_path}/data/train-*.parquet"
    with pytest.raises(DatasetError) as refused:
        describe_dataset(glob, access=DataAccess(unpack_root=tmp_path / "u"))
    pattern = f"{tmp_path}/data/train-{{00000..00002}}-of-00003.parquet"
    assert str(refused.value) == (
        f"calibration data not found: {glob}; globs (*, ?, [...]) are not expanded: give its 3 matches as the "
        f"brace pattern '{pattern}'"
    )
    assert describe_dataset(pattern, access=DataAccess(unpack_root=tmp_path / "u")).num_samples == 9  # the advice works


def test_a_glob_of_images_or_of_nothing_says_what_to_give(tmp_path):
    write_folder(tmp_path / "imgs", photos(3, size=32), class_folders=False)
    assert glob_hint(f"{tmp_path}/imgs/*.jpg") == (
        f"globs (*, ?, [...]) are not expanded: give the folder its 3 matches lie in ({tmp_path}/imgs)"
    )
    assert glob_hint(f"{tmp_path}/none-*.tar") == (
        "globs (*, ?, [...]) are not expanded, and it matches no file either: name shards with a brace pattern "
        "such as 'train-{000000..000146}.tar' ({000..146} ranges keep the zero padding, {a,b} lists)"
    )
    assert glob_hint(f"{tmp_path}/imgs") == ""
