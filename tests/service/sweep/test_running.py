"""A sweep of files run from Python (``sweep_to_files``): a cancellation mid-pass stops the
sweep, the cells done stay, the rest are ``cancelled`` in the matrix, nothing hangs."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from bnrecal.errors import CancelledError
from bnrecal.service.run.options import RunOptions
from bnrecal.service.sweep.cells import CalibrationSet, SweepModel
from bnrecal.service.sweep.cells import SweepFiles
from bnrecal.service.sweep.running import SweepRun, sweep_to_files
from tests.conftest import save_array, save_state
from tests.nets import mixed_net, perturbed


def test_cancel_mid_pass_stops_the_sweep_and_keeps_what_is_done(tmp_path, settings):
    models = [SweepModel(f"m{i}", "tests.nets:mixed_net", save_state(tmp_path / f"m{i}.pt", perturbed(mixed_net(), i)))
              for i in range(3)]
    data = save_array(tmp_path / "x.npy", torch.randn(64, 3, 6, 5))
    sweep = SweepFiles(models, [CalibrationSet("a", data), CalibrationSet("b", data)])
    cancel, finished = threading.Event(), []

    def on_progress(done, total, phase):
        if len(finished) == 1 and "calibrating" in phase and done >= 16:  # the second cell, mid-pass
            cancel.set()

    with pytest.raises(CancelledError):
        sweep_to_files(sweep, SweepRun(RunOptions(batch_size=8), "worst_drift"), settings, tmp_path / "out",
                       on_cell=finished.append, on_progress=on_progress, cancel=cancel)
    matrix = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [c["status"] for c in matrix["cells"]] == ["succeeded"] + ["cancelled"] * 5
    assert matrix["succeeded"] == 1 and matrix["cancelled"] == 5
    assert (tmp_path / "out" / "m0" / "a" / "m0.pt").is_file() and not (tmp_path / "out" / "m0" / "b" / "m0.pt").exists()
