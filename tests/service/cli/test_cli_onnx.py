"""`--onnx` on calibrate and `bnrecal export`: a verified, folded file, or none at all."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from tests.conftest import save_array, save_state
from tests.nets import mixed_net, perturbed
from tests.conftest import run_cli


pytestmark = pytest.mark.usefixtures("cli_environment")


@pytest.fixture
def group_umask() -> Iterator[int]:
    """A umask under which mkstemp's 0600 and the usual mode differ in every class of user."""
    before = os.umask(0o002)
    try:
        yield 0o002
    finally:
        os.umask(before)


def assert_usual_mode(umask: int, *paths: Path) -> None:
    """Each file has the mode a plain ``open(path, "w")`` would have given it under ``umask``."""
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, (path.name, oct(path.stat().st_mode))


def onnx_outputs(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


@pytest.mark.usefixtures("ray_cluster")
def test_calibrate_with_onnx_ships_the_recalibrated_model(tmp_path, capsys, group_umask):
    torch.manual_seed(4)
    samples = torch.randn(16, 3, 6, 5) * 2
    checkpoint = save_state(tmp_path / "m.pt", perturbed(mixed_net()))
    data = save_array(tmp_path / "x.npy", samples.numpy())
    code, _, err = run_cli(
        capsys, "calibrate", "--arch", "tests.nets:mixed_net", "--checkpoint", str(checkpoint), "--data", str(data),
        "--batch-size", "8", "--out", str(tmp_path / "out.pt"), "--onnx", str(tmp_path / "m.onnx"),
        "--report", str(tmp_path / "r.json"), "--report-html", str(tmp_path / "r.html"),
    )
    assert code == 0, err
    assert_usual_mode(group_umask, *(tmp_path / name for name in ("out.pt", "m.onnx", "r.json", "r.html")))
    section = json.loads((tmp_path / "r.json").read_text())["onnx"]
    for key in ("opset", "batchnorm_nodes", "folded", "unfolded", "max_abs_diff", "max_rel_diff"):
        assert key in section, key
    assert section["folded"] + section["batchnorm_nodes"] == 5
    assert {entry["name"] for entry in section["unfolded"]} == {"bn_plain"}  # after a ReLU: nothing to fold into
    recalibrated = mixed_net().eval()
    recalibrated.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True))
    x = np.random.default_rng(0).standard_normal((3, 3, 6, 5)).astype(np.float32)
    expected = recalibrated(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(onnx_outputs(tmp_path / "m.onnx", x), expected, atol=1e-4 * max(1, np.abs(expected).max()))


def test_export_without_recalibrating(tmp_path, capsys, group_umask):
    model = perturbed(mixed_net()).eval()
    checkpoint = save_state(tmp_path / "m.pt", model)
    code, _, err = run_cli(
        capsys, "export", "--arch", "tests.nets:mixed_net", "--checkpoint", str(checkpoint),
        "--input-shape", "3,6,5", "--out", str(tmp_path / "m.onnx"), "--report", str(tmp_path / "r.json"),
    )
    assert code == 0, err
    assert_usual_mode(group_umask, tmp_path / "m.onnx", tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["onnx"]["folded"] == 4
    x = np.random.default_rng(1).standard_normal((2, 3, 6, 5)).astype(np.float32)
    np.testing.assert_allclose(onnx_outputs(tmp_path / "m.onnx", x), model(torch.from_numpy(x)).detach().numpy(), atol=1e-4)


def test_export_needs_samples_or_a_shape(tmp_path, capsys):
    checkpoint = save_state(tmp_path / "m.pt", mixed_net())
    code, _, err = run_cli(capsys, "export", "--arch", "tests.nets:mixed_net", "--checkpoint", str(checkpoint),
                        "--out", str(tmp_path / "m.onnx"))
    assert code == 2 and "--input-shape" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists()
