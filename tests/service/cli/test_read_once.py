"""A whole job reads each photo once (docs/data.md, "Read once per job"): the statistics, the
evaluation, the INT8 range passes and the INT8 scores of a job on real photos given as both
its calibration and its evaluation data decode each photo once, on one worker in process
and on two ranks (paths shared, or shipped through the object store), in the fewest passes;
and what the ranks kept gives the very INT8 file and report figures that decoding again
gives."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_cli, save_state
from tests.nets import classifier_net, perturbed
from tests.shards import photos, write_folder

pytestmark = pytest.mark.usefixtures("cli_environment", "cli_warm_ranks")

SAMPLES = 24
FP32_READS = 2  # percentile: two reads of the one pass that runs both FP32 models (ranges, evaluation, scores)


@pytest.fixture(scope="module")
def job_inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("read-once")
    write_folder(folder / "photos", photos(SAMPLES, size=40))
    torch.manual_seed(3)
    return {"checkpoint": save_state(folder / "m.pt", perturbed(classifier_net(3))), "photos": folder / "photos"}


def whole_job(capsys, tmp_path, job_inputs, workers: int, name: str) -> dict:
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 3}',
        "--checkpoint", str(job_inputs["checkpoint"]), "--data", str(job_inputs["photos"]),
        "--eval-data", str(job_inputs["photos"]), "--transform", '{"resize": 20, "crop": 16}',
        "--workers", str(workers), "--batch-size", "8", "--out", str(tmp_path / f"{name}.pt"),
        "--onnx-int8", str(tmp_path / f"{name}.onnx"), "--int8", '{"method": "percentile"}',
        "--report", str(tmp_path / f"{name}.json"),
    )
    assert code == 0, err
    return json.loads((tmp_path / f"{name}.json").read_text())


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize(("workers", "transport"), [(1, "shared"), (2, "shared"), (2, "object_store")])
def test_a_whole_job_decodes_each_sample_once(tmp_path, capsys, monkeypatch, job_inputs, workers, transport):
    monkeypatch.setenv("BNRECAL_DATA_TRANSPORT", transport)
    report = whole_job(capsys, tmp_path, job_inputs, workers, "kept")
    decoding = report["decoding"]
    assert decoding["decoded"] == SAMPLES  # the photos are the calibration and the evaluation data: once in all
    assert decoding["reused"] == FP32_READS * SAMPLES + SAMPLES  # the FP32 models' pass, and the INT8 scores
    assert decoding["not_kept"] == 0 and decoding["spilled_bytes"] == 0
    assert decoding["kept_bytes"] == SAMPLES * 3 * 16 * 16  # uint8 crops
    timeline = {entry["phase"]: entry for entry in report["timeline"]}
    fused = timeline["INT8 ranges and evaluation before and after"]
    assert fused["passes"] == FP32_READS and fused["samples"] == FP32_READS * SAMPLES
    assert timeline["INT8 evaluations"]["passes"] == 1 and timeline["INT8 evaluations"]["samples"] == SAMPLES
    assert "INT8 ranges" not in timeline and "evaluation before and after" not in timeline
    where = "in-process" if workers == 1 else "ranks"
    assert {entry["where"] for entry in report["timeline"] if entry["samples"]} == {where}  # the host read none
    assert report["evaluation"]["runtime"] == "onnxruntime" and report["evaluation"]["samples"] == SAMPLES

    # Nothing kept (both budgets 0): every pass decodes again, and the files are the same.
    monkeypatch.setenv("BNRECAL_KEPT_MEMORY_MB", "0")
    monkeypatch.setenv("BNRECAL_KEPT_DISK_MB", "0")
    again = whole_job(capsys, tmp_path, job_inputs, workers, "decoded")
    assert again["decoding"]["decoded"] == SAMPLES + FP32_READS * SAMPLES + SAMPLES  # each read a decode
    assert again["decoding"]["reused"] == 0
    assert (tmp_path / "kept.onnx").read_bytes() == (tmp_path / "decoded.onnx").read_bytes()
    assert (tmp_path / "kept.pt").read_bytes() == (tmp_path / "decoded.pt").read_bytes()
    assert report["int8"]["evaluation"] == again["int8"]["evaluation"]
    assert report["evaluation"]["after"] == again["evaluation"]["after"]


def test_a_job_without_an_int8_file_keeps_nothing_and_counts_its_decodes(tmp_path, capsys, job_inputs):
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 3}',
        "--checkpoint", str(job_inputs["checkpoint"]), "--data", str(job_inputs["photos"]),
        "--transform", '{"resize": 20, "crop": 16}', "--out", str(tmp_path / "m.pt"), "--report", str(tmp_path / "r.json"),
    )
    assert code == 0, err
    decoding = json.loads((tmp_path / "r.json").read_text())["decoding"]
    assert decoding == {"decoded": SAMPLES, "reused": 0, "kept_bytes": 0, "spilled_bytes": 0, "not_kept": 0,
                        "memory_budget_bytes": 0, "disk_budget_bytes": 0}



@pytest.mark.usefixtures("ray_cluster")
def test_mds_shards_are_decoded_once_in_a_whole_job(tmp_path, capsys, job_inputs):
    """MosaicML Streaming's shards (the same photos, ``jpeg``) are read once per job as the other formats are."""
    from tests.shards import folder_order
    from tests.streaming_writer import MdsSet, write_mds

    (mds,) = write_mds(MdsSet(tmp_path / "mds", folder_order(photos(SAMPLES, size=40)), "jpeg", size_limit=20_000))
    assert len(list(mds.glob("*.mds"))) > 1
    decoding = whole_job(capsys, tmp_path, {**job_inputs, "photos": mds}, 1, "mds")["decoding"]
    assert decoding["decoded"] == SAMPLES and decoding["reused"] == FP32_READS * SAMPLES + SAMPLES
