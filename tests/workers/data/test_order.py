"""The seeded sample order (docs/calibration.md, "Order"): a prefix and every batch are a fair
draw, the same rows for every reader (local arrays, npz members, image folders, object
storage), labels follow their samples, and reads stay coalesced."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bnrecal.errors import DatasetOptionError
from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset, iter_batches, read_labels
from bnrecal.workers.data.order import order_rows, sorted_runs

from bnrecal.workers.ranks.sharding import rank_ranges

from tests.s3 import S3Server

IDENTITY = {"resize": 8, "crop": 8, "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}


def contract_order(total: int, seed: int = 0) -> np.ndarray:
    """The order as docs/calibration.md ("Order") states it, written out here: numpy's PCG64 permutation."""
    return np.random.Generator(np.random.PCG64(seed)).permutation(total)


def test_given_keeps_file_order_and_shuffled_is_a_seeded_permutation_whose_prefixes_nest() -> None:
    np.testing.assert_array_equal(order_rows(10, 4, "given", 7), np.arange(4))
    full = order_rows(1000, 1000, "shuffled", 3)
    np.testing.assert_array_equal(full, contract_order(1000, 3))
    assert sorted(full.tolist()) == list(range(1000))
    np.testing.assert_array_equal(order_rows(1000, 100, "shuffled", 3), full[:100])  # max_samples: a prefix
    assert not np.array_equal(order_rows(1000, 100, "shuffled", 4), full[:100])  # the seed matters
    with pytest.raises(ValueError, match="order must be one of"):
        order_rows(10, 10, "random", 0)


def test_sorted_runs_read_in_file_order_and_merge_close_rows() -> None:
    rows = np.array([9, 2, 3, 15, 4])
    permutation, runs = sorted_runs(rows)
    np.testing.assert_array_equal(rows[permutation], [2, 3, 4, 9, 15])
    assert runs == [(2, 5), (9, 10), (15, 16)]
    assert sorted_runs(rows, max_gap=4)[1] == [(2, 10), (15, 16)]  # 5 rows between 9 and 15: two runs
    assert sorted_runs(rows, max_gap=5)[1] == [(2, 16)]


@pytest.mark.parametrize("kind", ["npy", "npz", "npz-compressed", "uint8"])
def test_array_rows_come_in_the_seeded_order(tmp_path: Path, kind: str) -> None:
    rng = np.random.default_rng(0)
    if kind == "uint8":
        samples = rng.integers(0, 256, (97, 2, 3), dtype=np.uint8)
    else:
        samples = rng.standard_normal((97, 2, 3)).astype(np.float32)
    path = tmp_path / ("x.npy" if kind in ("npy", "uint8") else "x.npz")
    if path.suffix == ".npy":
        np.save(path, samples)
    else:
        (np.savez_compressed if kind == "npz-compressed" else np.savez)(path, x=samples)
    spec = describe_dataset(path, ReadOptions(order="shuffled", seed=5, max_samples=60))
    assert (spec.order, spec.seed, spec.num_samples, spec.total_samples) == ("shuffled", 5, 60, 97)
    expected = samples[contract_order(97, 5)[:60]].astype(np.float32)
    with spec.open() as data:
        steps = [data.load(start, min(start + 16, 60)).numpy() for start in range(0, 60, 16)]
        assert data.load(7, 7).shape == (0, 2, 3)
    np.testing.assert_array_equal(np.concatenate(steps), expected)
    assert (spec.summary().order, spec.summary().seed) == ("shuffled", 5)
    given = describe_dataset(path, ReadOptions(max_samples=60))
    assert given.order == "given"
    with given.open() as data:
        np.testing.assert_array_equal(data.load(0, 60).numpy(), samples[:60].astype(np.float32))


def test_class_folders_read_class_by_class_are_drawn_fairly_with_their_labels(tmp_path: Path) -> None:
    for label, name in enumerate(("ant", "bee", "cat", "dog")):
        (tmp_path / name).mkdir()
        for i in range(10):
            Image.new("RGB", (8, 8), (label * 60, i * 20, 0)).save(tmp_path / name / f"{i:02d}.png")
    given = describe_dataset(tmp_path, ReadOptions(transform=IDENTITY, max_samples=8))
    assert set(read_labels(given).tolist()) == {0}  # file order: the first 8 are all ants
    spec = describe_dataset(tmp_path, ReadOptions(transform=IDENTITY, max_samples=8, order="shuffled", seed=0))
    labels = read_labels(spec)
    assert len(set(labels.tolist())) >= 3  # a fair draw of 8 from 4 classes of 10
    files = sorted(f"{c}/{i:02d}.png" for c in ("ant", "bee", "cat", "dog") for i in range(10))
    expected = [files[r] for r in contract_order(40, 0)[:8]]
    with spec.open() as data:
        assert data.files == tuple(expected)
        red = data.load(0, 8)[:, 0, 0, 0].numpy() * 255
    np.testing.assert_allclose(red, labels * 60, atol=1e-3)  # each label belongs to its own image
    np.testing.assert_array_equal(labels, [("ant", "bee", "cat", "dog").index(f.split("/")[0]) for f in expected])


def test_npz_labels_follow_the_order(tmp_path: Path) -> None:
    x = np.arange(30, dtype=np.float32).reshape(30, 1, 1)
    np.savez(tmp_path / "e.npz", x=x, y=np.arange(30) % 7)
    spec = describe_dataset(tmp_path / "e.npz", ReadOptions(order="shuffled", seed=2, max_samples=12))
    with spec.open() as data:
        rows = data.load(0, 12).numpy().reshape(-1).astype(int)
    np.testing.assert_array_equal(read_labels(spec), rows % 7)


@pytest.mark.parametrize("option, value", [("order", "random"), ("seed", -1), ("seed", 1.5)])
def test_bad_order_options_name_their_field(tmp_path: Path, option: str, value: object) -> None:
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    with pytest.raises(DatasetOptionError) as caught:
        describe_dataset(tmp_path / "x.npy", ReadOptions(**{option: value}))
    assert caught.value.field == option


def test_remote_rows_in_the_order_are_fetched_as_few_coalesced_ranges(s3_server: S3Server, tmp_path: Path) -> None:
    samples = np.random.default_rng(3).standard_normal((400, 3, 8, 8)).astype(np.float32)  # 768 bytes a row
    buffer = io.BytesIO()
    np.save(buffer, samples)
    uri = s3_server.put("calib-data", "ordered/x.npy", buffer.getvalue())
    spec = describe_dataset(uri, ReadOptions(order="shuffled", seed=1), DataAccess(endpoint_url=s3_server.endpoint))
    order = contract_order(400, 1)
    with spec.open() as data:
        before = len(s3_server.gets("/calib-data/ordered/x.npy"))
        batch = data.load(0, 64).numpy()
        fetches = s3_server.gets("/calib-data/ordered/x.npy")[before:]
    np.testing.assert_array_equal(batch, samples[order[:64]])
    # 64 rows scattered over 400 lie within the gap of each other: far fewer requests than rows,
    # and never more bytes than the span they cover.
    assert 1 <= len(fetches) < 8
    span = (order[:64].max() - order[:64].min() + 1) * samples[0].nbytes
    assert sum(f.sent for f in fetches) <= span


def test_a_compressed_member_in_the_order_is_read_ahead_several_steps_per_pass(tmp_path: Path) -> None:
    samples = np.random.default_rng(4).standard_normal((300, 4, 4)).astype(np.float32)
    np.savez_compressed(tmp_path / "c.npz", x=samples)
    spec = describe_dataset(tmp_path / "c.npz", ReadOptions(order="shuffled", seed=9, max_samples=250))
    ranges = rank_ranges(250, 16, 2, 1)
    with spec.open() as data:
        got = np.concatenate([batch.numpy() for batch in iter_batches(data, ranges)])
    expected = samples[contract_order(300, 9)[:250]]
    np.testing.assert_array_equal(got, np.concatenate([expected[a:b] for a, b in ranges]))


def test_remote_rows_of_a_whole_shard_come_in_one_read_ahead(s3_server: S3Server) -> None:
    samples = np.random.default_rng(5).standard_normal((256, 3, 8, 8)).astype(np.float32)
    buffer = io.BytesIO()
    np.save(buffer, samples)
    uri = s3_server.put("calib-data", "ordered/ahead.npy", buffer.getvalue())
    spec = describe_dataset(uri, ReadOptions(order="shuffled", seed=2), DataAccess(endpoint_url=s3_server.endpoint))
    ranges = rank_ranges(256, 32, 2, 0)
    with spec.open() as data:
        before = len(s3_server.gets("/calib-data/ordered/ahead.npy"))
        got = np.concatenate([batch.numpy() for batch in iter_batches(data, ranges)])
        fetches = s3_server.gets("/calib-data/ordered/ahead.npy")[before:]
    expected = samples[contract_order(256, 2)]
    np.testing.assert_array_equal(got, np.concatenate([expected[a:b] for a, b in ranges]))
    assert sum(f.sent for f in fetches) <= samples.nbytes  # never more than the file, fetched together
