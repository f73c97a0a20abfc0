"""Checkpoints as training wrappers save them, recalibrated on a real local Ray cluster and
written back in their own layout (docs/models.md, "Checkpoint layouts")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import save_array
from tests.nets import mixed_net, perturbed
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics
from tests.workers.models.test_checkpoints import assert_same
from tests.wrappers import lightning_checkpoint

pytestmark = pytest.mark.usefixtures("ray_cluster")


def lightning(model: torch.nn.Module) -> tuple[Any, str]:
    """A Lightning ``.ckpt`` of a module holding the model as ``self.model``."""
    return lightning_checkpoint(model), "model."


def compiled(model: torch.nn.Module) -> tuple[Any, str]:
    """``torch.save(torch.compile(model).state_dict())``: ``_orig_mod.`` keys (nothing compiles)."""
    return torch.compile(model).state_dict(), "_orig_mod."


@pytest.mark.parametrize("wrap", [lightning, compiled], ids=["lightning", "torch.compile"])
def test_a_wrapped_checkpoint_calibrates_and_comes_back_in_its_own_layout(settings, tmp_path: Path, wrap, warm_pool) -> None:
    torch.manual_seed(3)
    model = perturbed(mixed_net())
    samples = torch.randn(19, 3, 6, 5) * 1.3 - 0.2
    container, prefix = wrap(model)
    path = tmp_path / "uploaded.ckpt"
    torch.save(container, path)
    request = RecalibrationRequest(
        arch="tests.nets:mixed_net", checkpoint=path, data=save_array(tmp_path / "x.npy", samples),
        workers=2, batch_size=5,
    )
    result = recalibrate(request, settings, pool=warm_pool)
    assert_matches_reference(result.model, reference_statistics(model, in_contract_order(samples), 5))

    out = tmp_path / "out.ckpt"
    result.save_model(out)
    original, written = torch.load(path, weights_only=True), torch.load(out, weights_only=True)
    is_lightning = "state_dict" in original
    before = original["state_dict"] if is_lightning else original
    after = written["state_dict"] if is_lightning else written
    assert list(after) == list(before) and all(key.startswith(prefix) for key in after)
    assert after._metadata == before._metadata
    for key, old in before.items():
        model_key = key.removeprefix(prefix)
        if model_key.endswith(("running_mean", "running_var")):
            assert torch.equal(after[key], result.updates[model_key].to(old.dtype)), key
            assert not torch.equal(after[key], old), key
        elif model_key.endswith("num_batches_tracked"):
            assert after[key].item() == old.item() + 4, key  # 19 samples in batches of 5
        else:
            assert_same(after[key], old, key)
    if is_lightning:
        assert list(written) == list(original)
        assert_same({k: v for k, v in written.items() if k != "state_dict"}, {k: v for k, v in original.items() if k != "state_dict"})
