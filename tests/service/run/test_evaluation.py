"""Evaluation before/after on a real local Ray cluster: the report's metrics against the
model's own forward in this process, through the engine, the CLI and the HTML report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bnrecal.workers.models.checkpoints import load_checkpoint, load_into_model
from bnrecal.workers.ranks.gangs.warm_context import warm_ranks

from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import save_array, save_state
from tests.nets import classifier_net, perturbed, segmenter_net
from tests.reference import assert_metrics_match, reference_metrics
from tests.conftest import run_cli

pytestmark = pytest.mark.usefixtures("ray_cluster")

CLASSES = 12


@pytest.fixture(scope="module")
def stale(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A classifier whose BN statistics do not match its data, calibration data, and a
    labelled evaluation set (.npz with x and y) drawn like the calibration data."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("stale")
    model = perturbed(classifier_net(CLASSES))
    calibration = torch.randn(40, 3, 8, 8) * 2 + 1
    evaluation = torch.randn(27, 3, 8, 8) * 2 + 1
    labels = np.random.default_rng(0).integers(0, CLASSES, 27)
    np.savez(folder / "eval.npz", x=evaluation.numpy(), y=labels)
    return {
        "checkpoint": save_state(folder / "model.pt", model),
        "data": save_array(folder / "calib.npy", calibration),
        "eval": folder / "eval.npz",
        "eval_x": save_array(folder / "eval_x.npy", evaluation),
    }


def expected_metrics(arch: str, checkpoint: Path, after: torch.nn.Module, x: torch.Tensor, y: np.ndarray | None):
    """The metrics from the model's own forward: uploaded statistics vs the recalibrated model."""
    from bnrecal.workers.models.architectures import build_model

    before = build_model(arch, {}, allowed_modules=("tests",))
    load_into_model(before, load_checkpoint(checkpoint))
    before.eval(), after.eval()
    with torch.no_grad():
        outputs = [m(x) for m in (before, after)]
    if isinstance(outputs[0], dict):
        outputs = [o["out"].movedim(1, -1).reshape(-1, o["out"].shape[1]) for o in outputs]
    return reference_metrics(*outputs, torch.from_numpy(y) if y is not None else None)


@pytest.mark.parametrize(
    ("mode", "workers", "transport"), [("sync", 2, "shared"), ("local", 3, "object_store")]
)
def test_labelled_evaluation_matches_the_models_own_forward(stale, settings, mode, workers, transport, warm_pool):
    settings = settings.model_copy(update={"data_transport": transport})
    phases: list[tuple[str, int, int]] = []
    request = RecalibrationRequest(
        arch="tests.nets:classifier_net", checkpoint=stale["checkpoint"], data=stale["data"],
        eval_data=stale["eval"], workers=workers, batch_size=8, mode=mode,
    )
    result = recalibrate(
        request, settings, on_progress=lambda done, total, phase: phases.append((phase, done, total)), pool=warm_pool
    )
    evaluation = result.report["evaluation"]
    with np.load(stale["eval"]) as arrays:
        x, y = torch.from_numpy(arrays["x"]), arrays["y"]
    expected = expected_metrics("tests.nets:classifier_net", stale["checkpoint"], result.model, x, y)
    assert evaluation["samples"] == 27 and evaluation["labelled"] and evaluation["classes"] == CLASSES
    assert_metrics_match(evaluation, expected, cross_entropy_rel=1e-4, kl_rel=1e-3)
    assert evaluation["after"]["cross_entropy"] != evaluation["before"]["cross_entropy"]
    assert evaluation["data"]["source"] == "eval.npz" and evaluation["collectives"] == 1
    assert result.report["object_store_bytes"] == ((40 + 27) * 3 * 8 * 8 * 4 if transport == "object_store" else 0)
    assert result.report["collectives"] == (1 if mode == "local" else 5)  # calibration: 5 steps x 1 BN
    # progress: each phase in order, its total known from its first event
    order = ["starting workers", "calibrating", "evaluating"]
    assert [p for p, *_ in phases] == sorted((p for p, *_ in phases), key=order.index)
    firsts = {phase: (done, total) for phase, done, total in reversed(phases)}
    assert phases[0] == ("starting workers", 0, 40) and firsts["calibrating"][1] == 40
    assert firsts["evaluating"][1] == 27 and all(done == 0 for phase, done, _ in phases if phase == "starting workers")
    assert ("calibrating", 40, 40) in phases and ("evaluating", 27, 27) in phases


def test_unlabelled_and_per_position_evaluation(stale, settings, tmp_path, warm_pool):
    result = recalibrate(
        RecalibrationRequest(
            arch="tests.nets:classifier_net", checkpoint=stale["checkpoint"], data=stale["data"],
            eval_data=stale["eval_x"], eval_max_samples=20, workers=2, batch_size=8,
        ),
        settings,
        pool=warm_pool,
    )
    evaluation = result.report["evaluation"]
    x = torch.from_numpy(np.load(stale["eval_x"]))[:20]
    expected = expected_metrics("tests.nets:classifier_net", stale["checkpoint"], result.model, x, None)
    assert evaluation["samples"] == 20 and not evaluation["labelled"] and "before" not in evaluation
    assert evaluation["kl_divergence"] == pytest.approx(expected["kl"], rel=1e-3)
    assert evaluation["prediction_change"] == pytest.approx(expected["changed"], abs=1e-12)

    torch.manual_seed(3)
    checkpoint = save_state(tmp_path / "seg.pt", perturbed(segmenter_net()))
    seg = recalibrate(
        RecalibrationRequest(
            arch="tests.nets:segmenter_net", checkpoint=checkpoint, data=stale["data"],
            eval_data=stale["eval"], workers=2, batch_size=8,
        ),
        settings,
        pool=warm_pool,
    )
    evaluation = seg.report["evaluation"]
    with np.load(stale["eval"]) as arrays:
        x = torch.from_numpy(arrays["x"])
    expected = expected_metrics("tests.nets:segmenter_net", checkpoint, seg.model, x, None)
    assert evaluation["output_shape"] == [5, 8, 8] and not evaluation["labelled"]
    assert "labels not used" in evaluation["note"]
    assert evaluation["prediction_change"] == pytest.approx(expected["changed"], abs=1e-12)
    assert evaluation["kl_divergence"] == pytest.approx(expected["kl"], rel=1e-3)


def write_image_classes(folder: Path, count: int) -> list[int]:
    """PNG images in class folders c00..c11; returns each image's label in sorted path order."""
    rng = np.random.default_rng(1)
    labels = []
    for index in range(count):
        label = int(rng.integers(0, CLASSES))
        target = folder / f"c{label:02d}"
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(target / f"{index:03d}.png")
    for name in sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png")):
        labels.append(int(name[1:3]))
    return labels


def test_cli_prints_before_and_after_and_the_html_report_shows_them(stale, tmp_path, capsys, monkeypatch, warm_pool):
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    images = tmp_path / "eval-images"
    labels = write_image_classes(images, 16)
    calibration = tmp_path / "calib-images"
    calibration.mkdir()
    for index, sample in enumerate(np.random.default_rng(2).integers(0, 255, (12, 8, 8, 3), dtype=np.uint8)):
        Image.fromarray(sample).save(calibration / f"{index:02d}.png")
    with warm_ranks(warm_pool):  # the command takes the run's warm ranks, as in tests/service/cli
        code, _, err = run_cli(
            capsys, "calibrate", "--arch", "tests.nets:classifier_net", "--checkpoint", str(stale["checkpoint"]),
            "--data", str(calibration), "--eval-data", str(images), "--transform", '{"resize": 8, "crop": 8}',
            "--workers", "2", "--batch-size", "8", "--out", str(tmp_path / "out.pt"),
            "--report", str(tmp_path / "report.json"), "--report-html", str(tmp_path / "report.html"),
        )
    assert code == 0, err
    import json

    report = json.loads((tmp_path / "report.json").read_text())
    evaluation = report["evaluation"]
    assert evaluation["samples"] == len(labels) and evaluation["labelled"]
    before, after = evaluation["before"], evaluation["after"]
    line = err.strip().splitlines()[-1]
    assert line == (
        f"evaluation on 16 samples: top-1 {before['top1']:.3f} -> {after['top1']:.3f}, "
        f"top-5 {before['top5']:.3f} -> {after['top5']:.3f}, "
        f"cross-entropy {before['cross_entropy']:.3f} -> {after['cross_entropy']:.3f}; "
        f"{evaluation['prediction_change']:.1%} of predictions changed"
    )
    html = (tmp_path / "report.html").read_text()
    assert "Evaluation" in html and f"{after['top1']:.3f}" in html and f"{before['top1']:.3f}" in html


def test_a_model_without_logits_or_too_few_classes_fails_before_any_actor(stale, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    torch.manual_seed(0)
    checkpoint = save_state(tmp_path / "features.pt", perturbed(__import__("tests.nets").nets.feature_list_net()))
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:feature_list_net", "--checkpoint", str(checkpoint),
        "--data", str(stale["data"]), "--eval-data", str(stale["eval"]), "--out", str(tmp_path / "never.pt"),
    )
    assert code == 2 and err.count("\n") == 1, err
    assert "evaluation needs a tensor of logits; the model returns a mapping with keys ['shape']" in err
    small = save_state(tmp_path / "small.pt", perturbed(classifier_net(5)))
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 5}',
        "--checkpoint", str(small), "--data", str(stale["data"]), "--eval-data", str(stale["eval"]),
        "--out", str(tmp_path / "never.pt"),
    )
    assert code == 2 and "labels go up to 11 but the model outputs 5 classes" in err
    assert not (tmp_path / "never.pt").exists()
