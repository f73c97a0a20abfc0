"""Hugging Face ``transformers`` models end to end on a real local Ray: config.json and
the model.safetensors of ``save_pretrained`` in, two ranks in sync mode, statistics
against the independent float64 reference, the checkpoint back in its own format (still
loadable by ``from_pretrained``), and the folded ONNX export verified in onnxruntime.

The jobs take their ranks from the test run's warm pool (``warm_pool``, as the server's jobs
do), so they pay no actor start-up once an earlier job of the same shape has. ResNet, RegNet and EfficientNet run by default,
MobileNetV2 with the ``slow`` tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from bnrecal.workers.engine.batchnorm import find_batchnorm_layers
from bnrecal.errors import ArchitectureError

from bnrecal.service.jobserver.jobs.submission import check_architecture
from bnrecal.service.run.outputs.exports import export_recalibrated
from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import save_array
from tests.hf import SIZE, TINY, save_pretrained, tiny_model
from tests.programs import buffers_as_modules, export_program
from tests.reference import assert_matches_reference, assert_metrics_match, in_contract_order, reference_metrics, reference_statistics
from tests.service.export.helpers import assert_matches_torch, run_onnx
from tests.zoo import stale

transformers = pytest.importorskip(
    "transformers", reason="the transformers extra is part of the test extras: pip install -e '.[test]'"
)
pytestmark = pytest.mark.usefixtures("ray_cluster")

SAMPLES = 20
BATCH = 8  # 3 steps, the last one short


def prepared(folder: Path, name: str, **overrides) -> tuple[torch.nn.Module, dict, Path, torch.Tensor, Path]:
    """A tiny stale model saved with save_pretrained, and calibration samples as .npy."""
    model = stale(tiny_model(name, **overrides))
    config, weights = save_pretrained(model, folder)
    torch.manual_seed(1)
    samples = torch.randn(SAMPLES, 3, SIZE, SIZE) * 1.2 + 0.1
    return model, config, weights, samples, save_array(folder / "calib.npy", samples)


# MobileNetV2 (52 BN layers at its smallest) spends most of its ~20 s in the export: its export
# is left to the zoo's torchvision mobilenet_v2 (the same blocks), its statistics are checked here.
CASES = [pytest.param(name, marks=[pytest.mark.slow] if name.startswith("MobileNetV2") else []) for name in TINY]
EXPORTED = {name for name in TINY if not name.startswith("MobileNetV2")}


@pytest.mark.parametrize("name", CASES)
def test_two_ranks_in_sync_match_the_reference_and_export_folded(name, settings, warm_pool, tmp_path):
    model, config, weights, samples, data = prepared(tmp_path, name)
    request = RecalibrationRequest(
        arch=f"transformers:{name}", model_kwargs=config, checkpoint=weights, data=data, workers=2,
        batch_size=BATCH, mode="sync",
    )
    result = recalibrate(request, settings, pool=warm_pool)

    expected = reference_statistics(model, in_contract_order(samples), BATCH)
    float32 = reference_statistics(model, in_contract_order(samples), BATCH, dtype=torch.float32)
    assert_matches_reference(result.model, expected, float32_reference=float32)
    report = result.report
    layers = len(find_batchnorm_layers(model)[0])
    assert len(report["layers"]) == layers and report["skipped"] == []
    assert report["world_size"] == 2 and report["mode"] == "sync" and report["steps"] == 3
    assert {layer["calls"] for layer in report["layers"]} == {3}  # each layer once per step
    assert report["collectives"] == 3 * layers  # one allreduce per BN call
    assert max(layer["mean_shift"] for layer in report["layers"]) > 0.5  # the statistics were stale

    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    result.save_model(out)
    with safe_open(str(weights), "pt") as before, safe_open(str(out), "pt") as after:
        assert after.metadata() == before.metadata() and set(after.keys()) == set(before.keys())
        for key in before.keys():
            old, new = before.get_tensor(key), after.get_tensor(key)
            assert old.dtype == new.dtype and old.shape == new.shape
            if key.endswith(("running_mean", "running_var")):
                assert not torch.equal(old, new), key
            elif key.endswith("num_batches_tracked"):
                assert new.item() == old.item() + 3
            else:
                assert torch.equal(old, new), key
    (out.parent / "config.json").write_text(json.dumps(config))
    reloaded = getattr(transformers, name).from_pretrained(out.parent, local_files_only=True).eval()
    x = samples[8:11]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, result.model.eval()(x).logits, rtol=0, atol=0)

    if name not in EXPORTED:
        return
    onnx = export_recalibrated(result, tmp_path / "model.onnx")
    assert onnx["batchnorm_nodes"] == 0 and onnx["unfolded"] == [] and onnx["folded"] == layers
    assert_matches_torch(tmp_path / "model.onnx", result.model, x)  # a batch size the export never verified


def test_a_transformers_model_goes_through_as_a_program(settings, warm_pool, tmp_path):
    """The same model exported with torch.export: no transformers code needed to calibrate it."""
    name = "ResNetForImageClassification"
    model, _, _, samples, data = prepared(tmp_path, name)
    program = export_program(model, samples[:1], tmp_path / "resnet.pt2")
    request = RecalibrationRequest(program=program, data=data, workers=2, batch_size=BATCH)
    result = recalibrate(request, settings, pool=warm_pool)
    expected = reference_statistics(model, in_contract_order(samples), BATCH)
    float32 = reference_statistics(model, in_contract_order(samples), BATCH, dtype=torch.float32)
    assert_matches_reference(buffers_as_modules(result.model), expected, float32_reference=float32)
    assert len(result.report["layers"]) == len(find_batchnorm_layers(model)[0])
    onnx = export_recalibrated(result, tmp_path / "model.onnx")
    assert onnx["batchnorm_nodes"] == 0 and onnx["batch"] == 1


def test_labelled_evaluation_reads_the_logits(settings, warm_pool, tmp_path):
    classes = 12  # top-5 is reported from 10 classes on
    name = "ResNetForImageClassification"
    model, config, weights, _, data = prepared(tmp_path, name, num_labels=classes)
    evaluation = torch.randn(14, 3, SIZE, SIZE) * 1.2 + 0.1
    labels = np.random.default_rng(0).integers(0, classes, 14)
    np.savez(tmp_path / "eval.npz", x=evaluation.numpy(), y=labels)
    request = RecalibrationRequest(
        arch=f"transformers:{name}", model_kwargs=config, checkpoint=weights, data=data, workers=2,
        batch_size=BATCH, eval_data=tmp_path / "eval.npz",
    )
    result = recalibrate(request, settings, pool=warm_pool)
    metrics = result.report["evaluation"]
    assert metrics["samples"] == 14 and metrics["labelled"] and metrics["classes"] == classes
    with torch.no_grad():
        before, after = model(evaluation).logits, result.model.eval()(evaluation).logits
    assert_metrics_match(metrics, reference_metrics(before, after, torch.from_numpy(labels)),
                         cross_entropy_rel=1e-4, kl_rel=1e-3)
    assert metrics["after"]["cross_entropy"] != metrics["before"]["cross_entropy"]


def test_model_outputs_with_hidden_states_export_every_tensor(settings, warm_pool, tmp_path):
    name = "RegNetForImageClassification"
    _, config, weights, samples, data = prepared(tmp_path, name, output_hidden_states=True)
    request = RecalibrationRequest(
        arch=f"transformers:{name}", model_kwargs=config, checkpoint=weights, data=data, workers=2, batch_size=BATCH,
    )
    result = recalibrate(request, settings, pool=warm_pool)
    x = samples[8:11]
    with torch.no_grad():
        output = result.model.eval()(x)
    expected = [output.logits, *output.hidden_states]  # in ONNX as in the ModelOutput: logits, then each state
    assert len(expected) > 2
    onnx = export_recalibrated(result, tmp_path / "model.onnx")
    assert onnx["batchnorm_nodes"] == 0
    got = run_onnx(tmp_path / "model.onnx", x)
    assert [g.shape for g in got] == [tuple(e.shape) for e in expected]
    for onnx_out, torch_out in zip(got, expected):
        np.testing.assert_allclose(onnx_out, torch_out.numpy(), rtol=0, atol=1e-4 * max(1.0, torch_out.abs().max().item()))


def test_job_submission_checks_the_class(settings):
    check_architecture("transformers:RegNetForImageClassification", settings)
    with pytest.raises(ArchitectureError, match="did you mean RegNetForImageClassification"):
        check_architecture("transformers:RegnetForImageClassification", settings)
    with pytest.raises(ArchitectureError, match="configuration class"):
        check_architecture("transformers:RegNetConfig", settings)


@pytest.mark.slow
def test_the_command_line_of_the_docs(tmp_path, capsys):
    """docs/models.md's example: save_pretrained's two files in, a folder from_pretrained loads out."""
    from tests.conftest import run_cli

    name = "ResNetForImageClassification"
    model, config, weights, _, data = prepared(tmp_path / "my-model", name)
    out, onnx, report = tmp_path / "recalibrated" / "model.safetensors", tmp_path / "model.onnx", tmp_path / "report.json"
    out.parent.mkdir()
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", f"transformers:{name}",
        "--model-kwargs", (tmp_path / "my-model" / "config.json").read_text(), "--checkpoint", str(weights),
        "--data", str(data), "--workers", "2", "--out", str(out), "--onnx", str(onnx), "--report", str(report),
    )
    assert code == 0, err
    (out.parent / "config.json").write_text(json.dumps(config))
    reloaded = transformers.ResNetForImageClassification.from_pretrained(out.parent, local_files_only=True)
    written = json.loads(report.read_text())
    assert written["onnx"]["batchnorm_nodes"] == 0 and written["onnx"]["folded"] == len(written["layers"])
    layer = written["layers"][0]["name"]
    assert not torch.equal(reloaded.get_submodule(layer).running_mean, model.get_submodule(layer).running_mean)
