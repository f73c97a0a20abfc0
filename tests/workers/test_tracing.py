"""What traces or runs a model's forward on a host takes turns (workers/tracing.py): while
one thread holds the tracing lock (an export, a torch.fx trace), another's probe, trace or
export waits for it, so a server's jobs or a sweep's cells side by side never run a forward
through a tracer's patched ``Module.__call__``."""

from __future__ import annotations

import threading

import pytest
import torch

from bnrecal.service.export.exporters import export_unfolded
from bnrecal.service.export.folding.in_torch import fold_batchnorm_modules
from bnrecal.workers.engine.calibrator import probe_call_order
from bnrecal.workers.engine.batchnorm import require_batchnorm_layers
from bnrecal.workers.tracing import MODEL_TRACING
from tests.nets import mixed_net


def _probe(model: torch.nn.Module, sample: torch.Tensor) -> None:
    layers, _ = require_batchnorm_layers(model, "model")
    probe_call_order(model, layers, sample)


def _export(model: torch.nn.Module, sample: torch.Tensor) -> None:
    export_unfolded(model.eval(), sample, opset=17, dynamic_batch=False, n_outputs=1)


def _fold(model: torch.nn.Module, sample: torch.Tensor) -> None:
    fold_batchnorm_modules(model.eval(), sample)


@pytest.mark.parametrize("work", [_probe, _export, _fold], ids=["probe", "export", "fx trace"])
def test_model_work_waits_while_another_thread_traces(work):
    model, sample = mixed_net(), torch.randn(2, 3, 6, 5)
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work(model, sample)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)
        finally:
            done.set()

    with MODEL_TRACING:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert not done.wait(0.5), "it ran while another thread held the tracing lock"
    assert done.wait(60) and not failed, failed
    thread.join()
