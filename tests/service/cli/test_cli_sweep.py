"""``bnrecal sweep`` as a user runs it: every cell is byte for byte the single ``calibrate`` of
its model and set (checkpoint, ONNX, INT8), each set's photos are decoded once for all the
models, a failing cell fails alone, bad input is refused before any work, and per-site
statistics beat pooled ones where the sites differ (docs/sweeps.md)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_cli, save_array, save_state
from tests.nets import classifier_net, mixed_net, no_norm_net, perturbed, volume_net
from tests.shards import photos, write_folder

pytestmark = pytest.mark.usefixtures("cli_environment", "cli_warm_ranks")


@pytest.fixture(scope="module")
def sweep_inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    for seed in range(2):
        torch.manual_seed(seed)
        save_state(folder / f"m{seed}.pt", perturbed(mixed_net(), seed))
    torch.manual_seed(9)
    save_array(folder / "a.npy", torch.randn(20, 3, 6, 5))
    save_array(folder / "b.npy", torch.randn(20, 3, 6, 5) * 2 + 1)
    (folder / "models.txt").write_text("m0.pt\nm1.pt\n")
    return folder


def _calibrate(capsys, folder: Path, checkpoint: Path, data: Path, *extra: str) -> None:
    code, _, err = run_cli(capsys, "calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(checkpoint),
                           "--data", str(data), "--batch-size", "8", "--out", str(folder / checkpoint.name), *extra)
    assert code == 0, err


@pytest.fixture(scope="module")
def single_jobs(tmp_path_factory, sweep_inputs):
    """The single ``calibrate`` of a model and set with so many workers, run once for the
    module: the sweeps of one worker, a cell at a time or side by side, compare with the same."""
    made: dict[tuple[str, str, int], Path] = {}

    def single(capsys, model: str, set_name: str, data: str, workers: int) -> Path:
        if (model, set_name, workers) not in made:
            folder = tmp_path_factory.mktemp(f"single-{model}-{set_name}-{workers}")
            _calibrate(capsys, folder, sweep_inputs / f"{model}.pt", sweep_inputs / data, "--workers", str(workers),
                       "--onnx", str(folder / "model.onnx"), "--report", str(folder / "report.json"))
            made[model, set_name, workers] = folder
        return made[model, set_name, workers]

    return single


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize(("workers", "at_once"), [(1, 1), (2, 1), (1, 2)])
def test_every_cell_is_byte_identical_to_its_single_calibrate(capsys, tmp_path, sweep_inputs, single_jobs, workers,
                                                              at_once):
    code, out, err = run_cli(
        capsys, "sweep", "--models", str(sweep_inputs / "models.txt"), "--arch", "tests.nets:mixed_net",
        "--data", f"A={sweep_inputs / 'a.npy'}", "--data", f"B={sweep_inputs / 'b.npy'}", "--batch-size", "8",
        "--workers", str(workers), "--onnx", "--out-dir", str(tmp_path / "out"), "--cells-at-once", str(at_once),
    )
    assert code == 0, err
    assert "swept 2 models x 2 sets: 4 cells succeeded, 0 failed" in out + err
    singles = [("m1", "B", "b.npy")] if workers > 1 else [("m0", "A", "a.npy"), ("m1", "B", "b.npy")]
    for model, set_name, data in singles:  # a later model over a set an earlier one read, and the first cell
        single = single_jobs(capsys, model, set_name, data, workers)
        cell = tmp_path / "out" / model / set_name
        assert (cell / f"{model}.pt").read_bytes() == (single / f"{model}.pt").read_bytes()
        assert (cell / "model.onnx").read_bytes() == (single / "model.onnx").read_bytes()
        mine, theirs = json.loads((cell / "report.json").read_text()), json.loads((single / "report.json").read_text())
        assert mine["layers"] == theirs["layers"] and mine["samples"] == theirs["samples"]
    matrix = json.loads((tmp_path / "out" / "sweep.json").read_text())
    cells = [(c["model"], c["set"], c["status"]) for c in matrix["cells"]]  # side by side: in the order they finished
    assert (sorted(cells) if at_once > 1 else cells) == [
        ("m0", "A", "succeeded"), ("m0", "B", "succeeded"), ("m1", "A", "succeeded"), ("m1", "B", "succeeded")]
    assert matrix["rank_by"] == "worst_drift" and len(matrix["ranking"]) == 4


@pytest.fixture(scope="module")
def photo_inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep-photos")
    write_folder(folder / "day", photos(16, size=40))
    write_folder(folder / "night", photos(16, size=40, seed=5))
    for seed in range(2):
        torch.manual_seed(seed)
        save_state(folder / f"c{seed}.pt", perturbed(classifier_net(3), seed))
    (folder / "models.txt").write_text('c0.pt\n{"checkpoint": "c1.pt", "name": "second"}\n')
    return folder


def test_photos_are_decoded_once_for_every_model_and_int8_matches(capsys, tmp_path, photo_inputs, monkeypatch):
    """Each set's photos are decoded once for both models and their INT8 passes; a cell's INT8
    file is its single job's; the sweep's ``keep_float`` is checked against an exported graph
    on the host once (the first cell), not once per cell."""
    import bnrecal.service.run.outputs.int8_names as int8_names

    preflights: list[str] = []
    real = int8_names.check_int8_names
    monkeypatch.setattr(int8_names, "check_int8_names", lambda *a, **k: preflights.append("check") or real(*a, **k))
    options = ("--transform", '{"resize": 20, "crop": 16}', "--batch-size", "8")
    int8 = ("--int8", '{"method": "minmax", "keep_float": ["Gemm"]}')
    code, _, err = run_cli(
        capsys, "sweep", "--models", str(photo_inputs / "models.txt"), "--arch", "tests.nets:classifier_net",
        "--model-kwargs", '{"classes": 3}', "--data", f"day={photo_inputs / 'day'}",
        "--data", f"night={photo_inputs / 'night'}", "--onnx-int8", *int8,
        "--out-dir", str(tmp_path / "out"), *options,
    )
    assert code == 0, err
    assert preflights == ["check"]
    matrix = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert matrix["decoding"]["decoded"] == 32  # 16 photos of each set, once for both models and the INT8 passes
    assert matrix["decoding"]["reused"] > 32
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 3}',
        "--checkpoint", str(photo_inputs / "c1.pt"), "--data", str(photo_inputs / "night"),
        "--onnx-int8", str(tmp_path / "single.int8.onnx"), *int8, "--out", str(tmp_path / "single.pt"), *options,
    )
    assert code == 0, err
    assert preflights == ["check", "check"]  # a single job checks before its calibration
    cell = tmp_path / "out" / "second" / "night"
    assert (cell / "c1.pt").read_bytes() == (tmp_path / "single.pt").read_bytes()
    assert (cell / "model.int8.onnx").read_bytes() == (tmp_path / "single.int8.onnx").read_bytes()


def test_a_failing_cell_fails_alone(capsys, tmp_path, sweep_inputs):
    save_state(tmp_path / "plain.pt", no_norm_net())
    manifest = tmp_path / "models.txt"
    manifest.write_text(f"{sweep_inputs / 'm0.pt'}\n"
                        f'{{"checkpoint": "plain.pt", "arch": "tests.nets:no_norm_net"}}\n'
                        f"{sweep_inputs / 'm1.pt'}\n")
    code, _, err = run_cli(
        capsys, "sweep", "--models", str(manifest), "--arch", "tests.nets:mixed_net",
        "--data", str(sweep_inputs / "a.npy"), "--batch-size", "8", "--out-dir", str(tmp_path / "out"),
    )
    assert code == 1
    assert "cell plain/data failed:" in err and "BatchNorm" in err
    rows = list(csv.DictReader(io.StringIO((tmp_path / "out" / "sweep.csv").read_text())))
    assert [(r["model"], r["status"]) for r in rows] == [("m0", "succeeded"), ("plain", "failed"), ("m1", "succeeded")]
    assert (tmp_path / "out" / "m1" / "data" / "m1.pt").is_file() and not (tmp_path / "out" / "plain" / "data" / "plain.pt").exists()


@pytest.mark.usefixtures("ray_cluster")
def test_a_cell_whose_export_fails_fails_alone_on_the_ranks(capsys, tmp_path, sweep_inputs):
    """The export runs on a rank (docs/onnx.md, "Where the export runs"): a cell whose folded
    weights overflow float16 fails there with the exporter's own error, and the cells before
    and after it keep their files."""
    torch.manual_seed(0)
    loud = perturbed(mixed_net(), 0)
    with torch.no_grad():
        loud.bn.weight.fill_(1e6)  # folded into the conv: far beyond float16's 65504
    save_state(tmp_path / "loud.pt", loud)
    manifest = tmp_path / "models.txt"
    manifest.write_text(f"{sweep_inputs / 'm0.pt'}\n{tmp_path / 'loud.pt'}\n{sweep_inputs / 'm1.pt'}\n")
    code, _, err = run_cli(
        capsys, "sweep", "--models", str(manifest), "--arch", "tests.nets:mixed_net",
        "--data", str(sweep_inputs / "a.npy"), "--batch-size", "8", "--workers", "2",
        "--onnx", "--onnx-dtype", "float16", "--out-dir", str(tmp_path / "out"),
    )
    assert code == 1, err
    assert "cell loud/data failed:" in err and "float16" in err and "'conv.weight'" in err
    matrix = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [(c["model"], c["status"]) for c in matrix["cells"]] == [
        ("m0", "succeeded"), ("loud", "failed"), ("m1", "succeeded")]
    assert "float16" in matrix["cells"][1]["error"]
    for good in ("m0", "m1"):
        cell = tmp_path / "out" / good / "data"
        assert (cell / f"{good}.pt").is_file() and (cell / "model.onnx").stat().st_size > 0
    assert not any((tmp_path / "out" / "loud" / "data").glob("*.onnx"))  # nothing half written


@pytest.mark.usefixtures("ray_cluster")
def test_the_checks_of_a_single_job_run_on_the_sweeps_ranks_with_its_errors_and_figures(
    capsys, tmp_path, photo_inputs, monkeypatch,
):
    """A single job checks its model on its host before any rank starts: the BN call order on
    the first sample (the model runs on the data) and what the evaluation can measure. A
    sweep's ranks are up already, so its cells make those checks there (docs/sweeps.md, "What
    is shared"): the host runs no forward per cell. A cell that fails a check fails alone
    with its single job's error, and a good cell's evaluation, measured by the INT8 export's
    passes by the target the ranks found, and its INT8 file are its single job's."""
    import bnrecal.workers.ranks.process.work as checks  # where the host's checks run (the ranks are other processes)

    host_forwards: list[str] = []
    for name in ("probe_call_order", "check_eval_output"):
        real = getattr(checks, name)
        monkeypatch.setattr(checks, name, lambda *a, _name=name, _real=real, **k: host_forwards.append(_name) or _real(*a, **k))
    torch.manual_seed(0)
    save_state(tmp_path / "two.pt", perturbed(classifier_net(2)))  # 2 classes: the photos' labels go up to 2
    torch.manual_seed(0)
    save_state(tmp_path / "volume.pt", perturbed(volume_net()))  # Conv3d: rejects photos
    kwargs = '"model_kwargs": {"classes": 3}'
    manifest = tmp_path / "models.txt"
    manifest.write_text(
        f'{{"checkpoint": "{photo_inputs / "c0.pt"}", {kwargs}}}\n'
        f'{{"checkpoint": "two.pt", "model_kwargs": {{"classes": 2}}}}\n'
        f'{{"checkpoint": "volume.pt", "arch": "tests.nets:volume_net"}}\n'
        f'{{"checkpoint": "{photo_inputs / "c1.pt"}", {kwargs}}}\n'
    )
    options = ("--transform", '{"resize": 20, "crop": 16}', "--batch-size", "8", "--workers", "2")
    files = ("--int8", '{"method": "minmax"}')
    code, _, err = run_cli(
        capsys, "sweep", "--models", str(manifest), "--arch", "tests.nets:classifier_net",
        "--data", f"day={photo_inputs / 'day'}", "--eval-data", f"day={photo_inputs / 'night'}",
        "--onnx-int8", *files, "--out-dir", str(tmp_path / "out"), *options,
    )
    assert code == 1, err
    assert host_forwards == []
    matrix = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [(c["model"], c["status"]) for c in matrix["cells"]] == [
        ("c0", "succeeded"), ("two", "failed"), ("volume", "failed"), ("c1", "succeeded")]
    (tmp_path / "single").mkdir()

    def single(checkpoint: Path, arch: str, kwargs: str, *extra: str) -> tuple[int, str]:
        code, _, err = run_cli(
            capsys, "calibrate", "--arch", arch, "--model-kwargs", kwargs, "--checkpoint", str(checkpoint),
            "--data", str(photo_inputs / "day"), "--eval-data", str(photo_inputs / "night"),
            "--out", str(tmp_path / "single" / checkpoint.name), *options, *extra,
        )
        return code, err

    for cell, checkpoint, arch, kwargs in [(1, tmp_path / "two.pt", "tests.nets:classifier_net", '{"classes": 2}'),
                                           (2, tmp_path / "volume.pt", "tests.nets:volume_net", "{}")]:
        code, err = single(checkpoint, arch, kwargs)
        assert code == 2 and matrix["cells"][cell]["error"] in err, (code, matrix["cells"][cell]["error"], err)
    assert "labels go up to 2 but the model outputs 2 classes" in matrix["cells"][1]["error"]
    assert "rejects samples of shape (3, 16, 16)" in matrix["cells"][2]["error"]
    assert host_forwards == ["probe_call_order", "check_eval_output", "probe_call_order"]  # single jobs: on their host
    code, err = single(photo_inputs / "c1.pt", "tests.nets:classifier_net", '{"classes": 3}', "--onnx-int8",
                       str(tmp_path / "single.int8.onnx"), "--report", str(tmp_path / "single.json"), *files)
    assert code == 0, err
    cell = tmp_path / "out" / "c1" / "day"
    assert (cell / "model.int8.onnx").read_bytes() == (tmp_path / "single.int8.onnx").read_bytes()
    mine, theirs = json.loads((cell / "report.json").read_text()), json.loads((tmp_path / "single.json").read_text())
    for report in (mine, theirs):
        report["evaluation"].pop("seconds")
    assert mine["evaluation"] == theirs["evaluation"] and mine["evaluation"]["labelled"]
    assert mine["int8"]["evaluation"] == theirs["int8"]["evaluation"]


@pytest.mark.parametrize(("args", "message"), [
    (("--data", "A=missing.npy"), "--data A missing.npy: no such file"),
    (("--data", "A=a.npy", "--data", "b.npy"), "--data b.npy: name each set as NAME=PATH"),
    (("--data", "a.npy", "--eval-data", "B=a.npy"), "--eval-data B: no calibration set of that name"),
    (("--data", "a.npy", "--rank-by", "accuracy"), "--rank-by must be one of"),
    (("--data", "a.npy", "--int8", "{}"), "--int8 sets the INT8 export's options"),
    (("--data", "a.npy", "--out-dir", "no/such/folder/out"), "--out-dir no/such/folder/out: its folder no/such/folder"),
])
def test_bad_input_is_refused_before_any_work(capsys, tmp_path, sweep_inputs, monkeypatch, args, message):
    monkeypatch.chdir(sweep_inputs)
    code, _, err = run_cli(capsys, "sweep", "--models", "models.txt", "--arch", "tests.nets:mixed_net",
                           "--out-dir", str(tmp_path / "out"), *args)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def _sites(seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Three cameras over the demo's digits (standardised as the model was trained): low
    contrast, a bright background, and a blur on a dark one; each site's unlabelled training
    scans and its held-out scans with labels."""
    from bnrecal.service import demo

    digits = demo.load_digits_split(seed)

    def cameras(x: torch.Tensor) -> dict[str, torch.Tensor]:
        blurred = torch.nn.functional.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
        return {"contrast": 0.35 * x + 0.6, "background": 0.6 * x + 1.8, "blur": 1.4 * blurred - 1.2}

    train, held_out = cameras(digits.train_x), cameras(digits.eval_x)
    return {name: (train[name].numpy(), held_out[name].numpy(), digits.eval_y.numpy()) for name in train}


def test_per_site_statistics_beat_pooled_ones_and_the_heatmap_shows_it(capsys, tmp_path, demo_inputs):
    sites, data = _sites(), []
    pooled = save_array(tmp_path / "pooled.npy", np.concatenate([calib for calib, _, _ in sites.values()]))
    for name, (calib, held_x, held_y) in sites.items():
        np.savez(tmp_path / f"{name}-eval.npz", x=held_x, y=held_y)
        data += ["--data", f"{name}={save_array(tmp_path / f'{name}.npy', calib)}",
                 "--eval-data", f"{name}={tmp_path / f'{name}-eval.npz'}",
                 "--data", f"pooled-{name}={pooled}", "--eval-data", f"pooled-{name}={tmp_path / f'{name}-eval.npz'}"]
    (tmp_path / "models.txt").write_text(f"{demo_inputs.checkpoint}\n")
    code, _, err = run_cli(
        capsys, "sweep", "--models", str(tmp_path / "models.txt"), "--arch", "torchvision:resnet18",
        "--model-kwargs", '{"num_classes": 10}', *data, "--batch-size", "64", "--max-samples", "512",
        "--out-dir", str(tmp_path / "out"),
    )
    assert code == 0, err
    matrix = json.loads((tmp_path / "out" / "sweep.json").read_text())
    top1 = {cell["set"]: cell["after_top1"] for cell in matrix["cells"]}
    for site in sites:
        assert top1[site] > top1[f"pooled-{site}"] + 0.02, (site, top1)
        assert top1[site] > 0.85, (site, top1)
    assert matrix["rank_by"] == "after_top1" and matrix["ranking"][-1].split("/")[1].startswith("pooled-")
    page = (tmp_path / "out" / "sweep.html").read_text()
    heatmap = page[page.index('id="heatmap-table"'):page.index('id="ranking"')]
    for site in sites:
        assert f">{top1[site]:.4g}</a>" in heatmap and f">{top1[f'pooled-{site}']:.4g}</a>" in heatmap


def test_pairs_run_only_the_cells_listed(capsys, tmp_path, sweep_inputs):
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("m0 B\nm1 A\n")
    code, _, err = run_cli(
        capsys, "sweep", "--models", str(sweep_inputs / "models.txt"), "--arch", "tests.nets:mixed_net",
        "--data", f"A={sweep_inputs / 'a.npy'}", "--data", f"B={sweep_inputs / 'b.npy'}", "--pairs", str(pairs),
        "--batch-size", "8", "--out-dir", str(tmp_path / "out"),
    )
    assert code == 0, err
    matrix = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [(c["model"], c["set"]) for c in matrix["cells"]] == [("m0", "B"), ("m1", "A")]
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").glob("*/*")) == ["m0/B", "m1/A"]
