"""`--onnx-int8` on calibrate and on `bnrecal export --data`: a checked INT8 file and its
report section; bad INT8 options exit 2 naming the field, before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from tests.conftest import save_array, save_state
from tests.nets import classifier_net, perturbed
from tests.conftest import run_cli


pytestmark = pytest.mark.usefixtures("cli_environment", "cli_warm_ranks")


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    torch.manual_seed(5)
    model = perturbed(classifier_net(6))
    calibration = torch.randn(40, 3, 8, 8) * 1.5 + 0.3
    evaluation = torch.randn(30, 3, 8, 8) * 1.5 + 0.3
    np.savez(tmp_path / "eval.npz", x=evaluation.numpy(), y=np.arange(30) % 6)
    return {
        "checkpoint": save_state(tmp_path / "m.pt", model),
        "data": save_array(tmp_path / "x.npy", calibration.numpy()),
        "eval": tmp_path / "eval.npz",
    }


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("transport", ["shared", "object_store"])
def test_calibrate_writes_a_checked_int8_model_and_its_report(tmp_path, capsys, inputs, monkeypatch, transport):
    """Shipped through the object store, each rank scores only its own evaluation samples:
    the same figures as read from shared paths."""
    monkeypatch.setenv("BNRECAL_DATA_TRANSPORT", transport)
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 6}',
        "--checkpoint", str(inputs["checkpoint"]), "--data", str(inputs["data"]), "--eval-data", str(inputs["eval"]),
        "--workers", "2", "--batch-size", "16", "--out", str(tmp_path / "out.pt"),
        "--onnx-int8", str(tmp_path / "m-int8.onnx"), "--int8", '{"method": "percentile"}',
        "--report", str(tmp_path / "r.json"),
    )
    assert code == 0, err
    onnx.checker.check_model(onnx.load(tmp_path / "m-int8.onnx"), full_check=True)
    section = json.loads((tmp_path / "r.json").read_text())["int8"]
    assert section["method"] == "percentile" and section["world_size"] == 2
    assert section["collectives"] == [2, 2] and section["samples"] == 40
    assert section["ops_quantized"]["Conv"] == 1
    assert set(section["evaluation"]) >= {"fp32", "int8", "stale_fp32", "stale_int8", "top1_drop_points"}
    assert "INT8" in err and "stale INT8" in err
    # The scores came from the ranks; here they are counted again, plainly: the INT8 file in
    # onnxruntime, the FP32 figures by the PyTorch models themselves (stale and recalibrated).
    evaluation = np.load(inputs["eval"])
    x, y = evaluation["x"].astype(np.float32), evaluation["y"]
    session = ort.InferenceSession(str(tmp_path / "m-int8.onnx"), providers=["CPUExecutionProvider"])
    int8_top1 = float(np.mean(session.run(None, {session.get_inputs()[0].name: x})[0].argmax(1) == y))
    assert section["evaluation"]["int8"]["top1"] == pytest.approx(int8_top1) and section["evaluation"]["samples"] == 30
    for key, weights in (("stale_fp32", inputs["checkpoint"]), ("fp32", tmp_path / "out.pt")):
        net = classifier_net(6)
        net.load_state_dict(torch.load(weights))
        with torch.no_grad():
            top1 = float(np.mean(net.eval()(torch.from_numpy(x)).argmax(1).numpy() == y))
        assert section["evaluation"][key]["top1"] == pytest.approx(top1), key
    # Every phase that reads samples ran on the ranks, the host read none; each model ran once
    # over each set of samples: both FP32 models' ranges in one pass (percentile reads twice),
    # both evaluated (before and after, and scored) in one pass, both INT8 models in one.
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["data_transport"] == transport
    timeline = {entry["phase"]: entry for entry in written["timeline"]}
    assert [p for p, entry in timeline.items() if entry["samples"] and entry["where"] != "ranks"] == []
    assert timeline["INT8 evaluations"]["passes"] == 1 and timeline["INT8 evaluations"]["samples"] == 30
    assert timeline["INT8 ranges"]["passes"] == 2 and timeline["INT8 ranges"]["samples"] == 80
    assert timeline["statistics"]["samples"] == 40
    assert timeline["evaluation before and after"]["passes"] == 1
    assert timeline["evaluation before and after"]["samples"] == 30
    assert written["evaluation"]["runtime"] == "onnxruntime" and written["evaluation"]["samples"] == 30


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--onnx-int8", "q.onnx", "--int8", '{"method": "kl"}'], "--int8.method"),
        (["--onnx-int8", "q.onnx", "--int8", '{"max_top1_drop": "one"}'], "--int8.max_top1_drop"),
        (["--int8", '{"method": "entropy"}'], "--onnx-int8"),
        (["--onnx-int8", "q.onnx", "--int8", '{"max_top1_drop": 1}'], "--eval-data"),
    ],
)
def test_bad_int8_options_exit_2_naming_the_field(tmp_path, capsys, inputs, args, named):
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:classifier_net", "--checkpoint", str(inputs["checkpoint"]),
        "--data", str(inputs["data"]), "--out", str(tmp_path / "out.pt"), *args,
    )
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0], err
    assert not (tmp_path / "out.pt").exists()


def test_export_quantizes_a_checkpoint_as_it_is(tmp_path, capsys, inputs):
    code, _, err = run_cli(
        capsys, "export", "--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 6}',
        "--checkpoint", str(inputs["checkpoint"]), "--data", str(inputs["data"]), "--out", str(tmp_path / "m.onnx"),
        "--onnx-int8", str(tmp_path / "m-int8.onnx"), "--report", str(tmp_path / "r.json"),
    )
    assert code == 0, err
    section = json.loads((tmp_path / "r.json").read_text())["int8"]
    assert section["world_size"] == 1 and section["samples"] == 40 and section["collectives"] == [1]
    onnx.checker.check_model(onnx.load(tmp_path / "m-int8.onnx"), full_check=True)
    code, _, err = run_cli(
        capsys, "export", "--arch", "tests.nets:classifier_net", "--checkpoint", str(inputs["checkpoint"]),
        "--input-shape", "3,8,8", "--out", str(tmp_path / "n.onnx"), "--onnx-int8", str(tmp_path / "n-int8.onnx"),
    )
    assert code == 2 and "--onnx-int8 needs --data" in err


@pytest.fixture
def mobilenet(tmp_path: Path) -> dict[str, Path]:
    """The issue's model kind: torchvision mobilenet_v2 (width 0.25 here, 16x16 inputs) with
    BN statistics off from the data, calibration and labelled evaluation data."""
    import torchvision

    torch.manual_seed(7)
    model = perturbed(torchvision.models.mobilenet_v2(num_classes=10, width_mult=0.25))
    calibration = torch.randn(48, 3, 16, 16)
    np.savez(tmp_path / "eval.npz", x=torch.randn(40, 3, 16, 16).numpy(), y=np.arange(40) % 10)
    return {
        "checkpoint": save_state(tmp_path / "stale.pt", model),
        "data": save_array(tmp_path / "calib.npy", calibration.numpy()),
        "eval": tmp_path / "eval.npz",
    }


@pytest.mark.usefixtures("ray_cluster")
def test_one_worker_run_with_evaluation_exports_the_graph_two_workers_export(tmp_path, capsys, mobilenet):
    """A one-worker run evaluates on the driver's own model (channels-last): its FP32 and
    INT8 files must still be the graph a two-worker run writes, and run alike in OpenVINO
    at a dynamic batch (the old code wrote an extra as_strided subgraph: 113 nodes, not 104).
    OpenVINO runs in a child process, as the product runs it (service/export/runtimes.py)."""
    from bnrecal.service.export.runtimes import run_openvino

    graphs, outputs = {}, {}
    batch = np.load(mobilenet["data"])[:8]
    for workers, evaluation in ((1, ["--eval-data", str(mobilenet["eval"])]), (2, [])):
        out = tmp_path / f"k{workers}"
        code, _, err = run_cli(
            capsys, "calibrate", "--arch", "torchvision:mobilenet_v2",
            "--model-kwargs", '{"num_classes": 10, "width_mult": 0.25}', "--checkpoint", str(mobilenet["checkpoint"]),
            "--data", str(mobilenet["data"]), *evaluation, "--workers", str(workers), "--batch-size", "16",
            "--out", f"{out}.pt", "--onnx", f"{out}.onnx", "--onnx-int8", f"{out}-int8.onnx", "--report", f"{out}.json",
        )
        assert code == 0, err
        report = json.loads(Path(f"{out}.json").read_text())
        assert report["onnx"]["runtimes"]["openvino"]["ran"] and report["int8"]["runtimes"]["openvino"]["ran"]
        for kind in ("", "-int8"):
            graph = onnx.load(f"{out}{kind}.onnx").graph
            graphs[workers, kind] = [(node.op_type, list(node.input)) for node in graph.node]
        outputs[workers] = run_openvino(Path(f"{out}-int8.onnx"), [batch]).outputs[0][0]
    assert graphs[1, ""] == graphs[2, ""] and graphs[1, "-int8"] == graphs[2, "-int8"]
    assert not any(op in ("Range", "Gather") for op, _ in graphs[1, ""])
    # Alike, not equal: the two runs' statistics differ by float rounding, so their INT8 ranges
    # do in the last bits, and INT8 outputs move by a quantization step (argmax can flip on a
    # near tie of this random-weight net); a graph read wrongly is off by the outputs' scale.
    assert np.abs(outputs[1] - outputs[2]).max() <= 0.1 * np.abs(outputs[2]).max()


@pytest.fixture
def outlier_inputs(tmp_path: Path) -> dict[str, Path]:
    """The outlier net's stale checkpoint, calibration and labelled evaluation data."""
    from tests.service.export.int8_helpers import write_outlier_inputs

    return write_outlier_inputs(tmp_path)


def test_guard_that_cannot_hold_still_writes_the_checkpoint_fp32_export_and_report(tmp_path, capsys, outlier_inputs):
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.service.export.int8_helpers:OutlierNet",
        "--checkpoint", str(outlier_inputs["checkpoint"]), "--data", str(outlier_inputs["data"]),
        "--eval-data", str(outlier_inputs["eval"]), "--workers", "1", "--batch-size", "32",
        "--out", str(tmp_path / "out.pt"), "--onnx", str(tmp_path / "m.onnx"), "--onnx-int8", str(tmp_path / "q.onnx"),
        "--int8", '{"max_top1_drop": 0.5, "max_float_ops": 0}', "--report", str(tmp_path / "r.json"),
    )
    assert code == 1, err
    assert (tmp_path / "out.pt").exists() and (tmp_path / "m.onnx").exists() and not (tmp_path / "q.onnx").exists()
    section = json.loads((tmp_path / "r.json").read_text())["int8"]
    assert section["written"] is False and "max_top1_drop 0.5" in section["failure"]
    assert section["guard"]["selection"]["samples"] == section["guard"]["report"]["samples"] == 64
    assert "not written" in err and "max_top1_drop" in err.splitlines()[-1]


def test_mistyped_keep_float_exits_2_before_any_calibration(tmp_path, capsys, inputs):
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 6}',
        "--checkpoint", str(inputs["checkpoint"]), "--data", str(inputs["data"]), "--workers", "1",
        "--out", str(tmp_path / "out.pt"), "--onnx-int8", str(tmp_path / "q.onnx"),
        "--int8", '{"keep_float": ["node_conv2d", "Gemn"]}',
    )
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--int8.keep_float: 'Gemn' names no node" in lines[0], err
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.usefixtures("ray_cluster")
def test_the_guard_measures_the_same_on_two_ranks_as_in_process(tmp_path, capsys):
    """The guard's measurements (the selection part, each op's sensitivity, every op kept)
    run on the ranks, 16 candidate files to a pass: the same choice, the same figures and the
    same written or not as one worker scoring in its own process (the files themselves differ
    in the last bits of the statistics, which the world size may round otherwise)."""
    from tests.service.export.int8_helpers import write_outlier_inputs

    inputs = write_outlier_inputs(tmp_path)
    sections, files = {}, {}
    for workers in (1, 2):
        out = tmp_path / f"k{workers}"
        code, _, err = run_cli(
            capsys, "calibrate", "--arch", "tests.service.export.int8_helpers:OutlierNet",
            "--checkpoint", str(inputs["checkpoint"]), "--data", str(inputs["data"]), "--eval-data", str(inputs["eval"]),
            "--workers", str(workers), "--batch-size", "32", "--out", f"{out}.pt", "--onnx-int8", f"{out}.onnx",
            "--int8", '{"max_top1_drop": 1.0, "max_float_ops": 2}', "--report", f"{out}.json",
        )
        report = json.loads(Path(f"{out}.json").read_text())
        sections[workers], timeline = report["int8"], {entry["phase"]: entry for entry in report["timeline"]}
        assert timeline["INT8 evaluations"]["where"] == ("in-process" if workers == 1 else "ranks")
        assert timeline["INT8 evaluations"]["passes"] >= 3  # the selection, the candidates, the report part
        # the quantizer's own work (the candidates' files among it) where the passes ran, not on the host
        assert timeline["INT8 quantizer and checks"]["where"] == timeline["INT8 evaluations"]["where"]
        files[workers] = Path(f"{out}.onnx").read_bytes() if code == 0 else None
    assert sections[1]["guard"] == sections[2]["guard"] and sections[1]["guard"]["kept_float"]
    assert sections[1]["evaluation"] == sections[2]["evaluation"]
    assert (files[1] is None) == (files[2] is None) == (not sections[1]["guard"]["held"])
