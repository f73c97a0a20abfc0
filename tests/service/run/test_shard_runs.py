"""Calibrating on shards, end to end: the same photos as a folder, as WebDataset tar shards, as
Parquet and as MosaicML Streaming's MDS (raw ``pil`` pixels; ``jpeg`` for the evaluation
data) give the same statistics with ``order: given`` and the same top-1; on tar shards
the statistics agree for K = 1, 2 and 4 ranks (sync mode); the CLI takes a brace pattern."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import run_cli, save_state
from tests.nets import classifier_net, perturbed
from tests.shards import folder_order, photos, write_folder, write_parquet, write_tar_shards
from tests.streaming_writer import MdsSet, write_mds

TRANSFORM = {"resize": 32, "crop": 32}
ARCH = "tests.nets:classifier_net"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    root = tmp_path_factory.mktemp("shardruns")
    torch.manual_seed(0)
    items = photos(120, size=40)
    evaluation = photos(45, size=40, seed=1)
    ordered, eval_ordered = folder_order(items), folder_order(evaluation)
    write_folder(root / "folder", items)
    write_folder(root / "eval-folder", evaluation)
    write_tar_shards(root / "tar", ordered, 50)
    write_tar_shards(root / "eval-tar", eval_ordered, 20, gz=True)
    write_parquet(root / "parquet", ordered, 64, row_group=16)
    write_parquet(root / "eval-parquet", eval_ordered, 45, row_group=10)
    write_tar_shards(root / "unlabelled", eval_ordered, 45, labels=False)
    write_mds(MdsSet(root / "mds", ordered, "pil", size_limit=1 << 17), MdsSet(root / "eval-mds", eval_ordered, "jpeg"))
    return {
        "mds": root / "mds", "eval-mds": root / "eval-mds",
        "checkpoint": save_state(root / "model.pt", perturbed(classifier_net(3))),
        "folder": root / "folder", "eval-folder": root / "eval-folder",
        "tar": str(root / "tar" / "train-{000000..000002}.tar"), "eval-tar": root / "eval-tar",
        "parquet": root / "parquet", "unlabelled": root / "unlabelled" / "train-000000.tar", "eval-parquet": root / "eval-parquet" / "data" / "train-00000-of-00001.parquet",
    }


def request(sources: dict[str, Path | str], data: str, **options: object) -> RecalibrationRequest:
    return RecalibrationRequest(
        arch=ARCH, model_kwargs={"classes": 3}, checkpoint=sources["checkpoint"], data=sources[data],
        transform=TRANSFORM, batch_size=16, **options,
    )


def test_folder_tar_shards_parquet_and_mds_calibrate_alike(sources, settings):
    results = {}
    for fmt in ("folder", "tar", "parquet", "mds"):
        results[fmt] = recalibrate(
            request(sources, fmt, eval_data=sources[f"eval-{fmt}"], order="given", workers=1), settings, in_process=True,
        )
    folder = results["folder"]
    assert results["mds"].report["evaluation"]["data"]["format"] == "mds"
    for fmt in ("tar", "parquet", "mds"):
        result = results[fmt]
        assert result.report["dataset"]["kind"] == "shards" and result.report["samples"] == 120
        for key, value in folder.updates.items():
            assert torch.equal(result.updates[key], value), (fmt, key)
        assert result.report["evaluation"]["after"]["top1"] == folder.report["evaluation"]["after"]["top1"]
        assert result.report["evaluation"]["samples"] == 45 and result.report["evaluation"]["labelled"]


@pytest.mark.usefixtures("ray_cluster")
def test_tar_shards_give_the_same_statistics_for_any_k(sources, settings, warm_pool):
    runs = {k: recalibrate(request(sources, "tar", workers=k), settings, pool=warm_pool) for k in (1, 2, 4)}
    for k in (2, 4):
        for key, value in runs[1].updates.items():
            assert torch.allclose(runs[k].updates[key].double(), value.double(), rtol=1e-5, atol=1e-7), (k, key)
    assert runs[4].report["order"] == "shuffled" and runs[4].report["world_size"] == 4


def test_cli_calibrates_on_a_brace_pattern_with_parquet_evaluation(sources, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", ARCH, "--model-kwargs", '{"classes": 3}', "--checkpoint", str(sources["checkpoint"]),
        "--data", str(sources["tar"]), "--eval-data", str(sources["eval-parquet"]), "--transform",
        '{"resize": 32, "crop": 32}', "--batch-size", "16", "--out", str(tmp_path / "out.pt"), "--report",
        str(tmp_path / "report.json"),
    )
    assert code == 0, err
    assert (tmp_path / "out.pt").is_file() and "top-1" in err
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", ARCH, "--model-kwargs", '{"classes": 3}', "--checkpoint", str(sources["checkpoint"]),
        "--data", str(sources["tar"]), "--eval-data", str(sources["unlabelled"]), "--transform",
        '{"resize": 32, "crop": 32}', "--out", str(tmp_path / "bad.pt"),
    )
    assert code == 2 and not (tmp_path / "bad.pt").exists()  # nothing written
    assert "shard train-000000.tar has no labels: no 000000_0.cls" in err and len(err.strip().splitlines()) == 1
