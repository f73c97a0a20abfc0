"""Recalibration on data in object storage (a local moto S3 server), on the real local
Ray: the same statistics as the local copy, each rank fetching only its own rows."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from bnrecal.errors import DatasetError
from bnrecal.workers.ranks.gangs.pool import WarmPool
from bnrecal.workers.ranks.sharding import rank_ranges

from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate
from bnrecal.service.settings import Settings

from tests.conftest import save_array, save_state
from tests.nets import mixed_net, perturbed
from tests.s3 import S3Server

pytestmark = pytest.mark.usefixtures("ray_cluster")
BUCKET = "recal-data"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mixed-s3")
    samples = torch.randn(203, 3, 6, 5) * 1.5 + 0.3
    return save_state(folder / "model.pt", perturbed(mixed_net())), save_array(folder / "x.npy", samples), samples


def run(settings: Settings, checkpoint: Path, data: Path | str, pool: WarmPool | None = None, **options: object):
    request = RecalibrationRequest(
        arch="tests.nets:mixed_net", checkpoint=checkpoint, data=data, workers=2, batch_size=16, **options
    )
    return recalibrate(request, settings, pool=pool)


@pytest.fixture(scope="module")
def local_result(mixed, tmp_path_factory: pytest.TempPathFactory, warm_pool: WarmPool):
    checkpoint, local, _ = mixed
    settings = Settings(data_dir=tmp_path_factory.mktemp("local-data"), model_modules=["tests"])
    return run(settings, checkpoint, local, warm_pool, max_samples=190)


@pytest.mark.parametrize(
    "kind, transport", [("npy", "shared"), ("npz", "object_store"), ("npz-compressed", "shared")]
)
def test_same_statistics_as_the_local_copy(
    s3_server: S3Server, settings: Settings, mixed, local_result, kind: str, transport: str, warm_pool: WarmPool
) -> None:
    checkpoint, local, samples = mixed
    if kind == "npy":
        payload, suffix = local.read_bytes(), ".npy"
    else:
        buffer = io.BytesIO()
        (np.savez_compressed if kind == "npz-compressed" else np.savez)(buffer, x=samples.numpy())
        payload, suffix = buffer.getvalue(), ".npz"
    uri = s3_server.put(BUCKET, f"{transport}/{kind}{suffix}", payload)
    settings = settings.model_copy(update={"s3_endpoint_url": s3_server.endpoint, "data_transport": transport})
    expected = local_result
    result = run(settings, checkpoint, uri, warm_pool, max_samples=190)
    assert result.updates.keys() == expected.updates.keys()
    for key, value in result.updates.items():
        torch.testing.assert_close(value, expected.updates[key], rtol=1e-6, atol=1e-7)  # same rows, same order
    report = result.report
    assert report["samples"] == 190 and result.dataset.source == uri and result.dataset.remote is not None
    assert report["data_transport"] == "remote" and report["object_store_bytes"] == 0


def test_each_rank_fetches_only_its_own_rows(s3_server: S3Server, settings: Settings, mixed, warm_pool: WarmPool) -> None:
    checkpoint, local, samples = mixed
    key = "ranged/x.npy"
    uri = s3_server.put(BUCKET, key, local)
    settings = settings.model_copy(update={"s3_endpoint_url": s3_server.endpoint})
    before = len(s3_server.gets(f"/{BUCKET}/{key}"))
    # In file order each rank's batch is one contiguous range; the shuffled order reads its rows
    # coalesced through small gaps (tests/workers/data/test_order.py), which is not this test's point.
    result = run(settings, checkpoint, uri, warm_pool, order="given")
    fetched = s3_server.gets(f"/{BUCKET}/{key}")[before:]
    layout = result.dataset.layout
    assert layout is not None
    row = samples[0].numel() * 4
    # Every read is ranged; the driver reads the header and one row (the shape probe), the ranks one range per batch.
    assert all(r.range is not None for r in fetched)
    ranges = {r.range for r in fetched}
    for rank in range(2):
        for start, stop in rank_ranges(203, 16, 2, rank):
            if start < stop:
                first = layout.data_offset + start * row
                assert f"bytes={first}-{first + (stop - start) * row - 1}" in ranges
    data_bytes = 203 * row
    assert data_bytes <= sum(r.sent for r in fetched) <= data_bytes + row + 16_384  # nothing read twice


def test_a_missing_key_fails_naming_the_uri(s3_server: S3Server, settings: Settings, mixed) -> None:
    checkpoint, _, _ = mixed
    s3_server.bucket(BUCKET)
    settings = settings.model_copy(update={"s3_endpoint_url": s3_server.endpoint})
    with pytest.raises(DatasetError, match=f"calibration data not found: s3://{BUCKET}/missing.npy"):
        run(settings, checkpoint, f"s3://{BUCKET}/missing.npy")


def test_an_image_prefix_gives_the_statistics_of_the_local_folder(
    s3_server: S3Server, settings: Settings, mixed, tmp_path: Path, warm_pool: WarmPool
) -> None:
    from PIL import Image

    checkpoint, _, _ = mixed
    rng = np.random.default_rng(5)
    folder = tmp_path / "images"
    for index in range(13):
        path = folder / ("cat" if index % 2 else "dog") / f"{index:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (9, 8, 3), dtype=np.uint8)).save(path)
    uri = s3_server.put_tree(BUCKET, "images/set", folder)
    settings = settings.model_copy(update={"s3_endpoint_url": s3_server.endpoint, "data_transport": "object_store"})
    transform = {"resize": 8, "crop": 6}
    expected = run(settings, checkpoint, folder, warm_pool, transform=transform)
    before = len(s3_server.requests)
    result = run(settings, checkpoint, uri, warm_pool, transform=transform)
    for key, value in result.updates.items():
        torch.testing.assert_close(value, expected.updates[key], rtol=1e-6, atol=1e-7)
    assert result.report["data_transport"] == "remote" and expected.report["object_store_bytes"] > 0
    image_gets = [r.path for r in s3_server.requests[before:] if r.method == "GET" and r.path.endswith(".png")]
    assert len(image_gets) == 13 + 1  # each image once by its rank, and the driver's one-sample probe
