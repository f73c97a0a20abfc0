"""Recalibration on a real local Ray cluster, against the float64 reference."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from bnrecal.errors import CancelledError, RunError
from bnrecal.workers.models.checkpoints import load_checkpoint

from bnrecal.service.run.outputs.exports import export_recalibrated
from bnrecal.service.run.outputs.later_phases import RunOutputs
from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net, mixed_net, perturbed
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.Tensor, Path, Path]:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mixed")
    model = perturbed(mixed_net())
    samples = torch.randn(23, 3, 6, 5) * 1.5 + 0.3
    return model, samples, save_state(folder / "model.pt", model), save_array(folder / "x.npy", samples)


def run(settings, checkpoint, data, pool=None, **options):
    request = RecalibrationRequest(arch="tests.nets:mixed_net", checkpoint=checkpoint, data=data, **options)
    return recalibrate(request, settings, pool=pool)


def test_sync_matches_reference_and_agrees_across_world_sizes(mixed, settings, warm_pool):
    model, samples, checkpoint, data = mixed
    expected = reference_statistics(model, in_contract_order(samples), batch_size=6)
    results = {k: run(settings, checkpoint, data, warm_pool, workers=k, batch_size=6) for k in (1, 2, 3)}
    for k, result in results.items():
        assert_matches_reference(result.model, expected)
        report = result.report
        assert report["world_size"] == k and report["backend"] == "gloo" and report["steps"] == 4
        assert report["collectives"] == 5 * 4  # one allreduce per BN call per step (5 calls a step)
        assert report["samples"] == 23 and len(report["nodes"]) == k
    base = results[1].updates
    for k in (2, 3):
        for key, value in results[k].updates.items():
            torch.testing.assert_close(value.double(), base[key].double(), rtol=1e-5, atol=1e-7)


def test_the_export_traced_on_the_host_while_the_ranks_compute_is_the_file_of_its_own_trace(
    mixed, settings, tmp_path, warm_pool,
):
    """A run on ranks traces its export on the host while they compute (docs/onnx.md, "Where
    the export runs"); the ranks' export from that trace is byte for byte the file the same
    recalibrated model traced anew in this process makes."""
    _, _, checkpoint, data = mixed
    request = RecalibrationRequest(arch="tests.nets:mixed_net", checkpoint=checkpoint, data=data, batch_size=6, workers=2)
    result = recalibrate(request, settings, pool=warm_pool, outputs=RunOutputs(onnx=tmp_path / "ranks.onnx"))
    assert result.traced is not None and result.traced.result() is not None
    section = export_recalibrated(result, tmp_path / "here.onnx")  # no trace given: it traces its own
    assert (tmp_path / "ranks.onnx").read_bytes() == (tmp_path / "here.onnx").read_bytes()
    assert result.report.onnx.folded == section.folded > 0


def test_local_mode_matches_per_rank_reference(mixed, settings, warm_pool):
    model, samples, checkpoint, data = mixed
    expected = reference_statistics(model, in_contract_order(samples), batch_size=12, world_size=2, mode="local")
    result = run(settings, checkpoint, data, warm_pool, workers=2, batch_size=12, mode="local")
    assert_matches_reference(result.model, expected)
    assert result.report["collectives"] == 1  # one allreduce per job


def test_empty_slices_take_part_in_every_collective(mixed, settings, warm_pool):
    model, samples, checkpoint, data = mixed
    # 10 samples, batch 4, 3 ranks: the last step has 2 samples, so rank 2's slice is empty.
    expected = reference_statistics(model, in_contract_order(samples)[:10], batch_size=4)
    result = run(settings, checkpoint, data, warm_pool, workers=3, batch_size=4, max_samples=10)
    assert_matches_reference(result.model, expected)
    assert result.report["collectives"] == 5 * 3


def test_checkpoint_keeps_everything_but_bn_statistics(mixed, settings, tmp_path, warm_pool):
    model, _, checkpoint, data = mixed
    result = run(settings, checkpoint, data, warm_pool, workers=2, batch_size=8)
    out = tmp_path / "out.pt"
    result.save_model(out)
    before, after = torch.load(checkpoint, weights_only=True), torch.load(out, weights_only=True)
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and before[key].shape == after[key].shape
        if key.endswith(("running_mean", "running_var")):
            assert not torch.equal(before[key], after[key])
        elif key.endswith("num_batches_tracked"):
            assert after[key].item() == before[key].item() + 3
        else:
            assert torch.equal(before[key], after[key]), key
    assert load_checkpoint(out).format == "torch"


def marked_data(tmp_path: Path) -> tuple[Path, Path]:
    model = marker_net()
    samples = torch.randn(40, 4)
    samples[4 * 3 + 3, 0] = MARKER  # step 3 of batch 4 with 2 ranks: rank 1's second sample
    return save_state(tmp_path / "m.pt", model), save_array(tmp_path / "m.npy", samples)


def test_a_rank_that_dies_fails_the_job_naming_it(settings, tmp_path):
    checkpoint, data = marked_data(tmp_path)
    request = RecalibrationRequest(arch="tests.nets:marker_net", checkpoint=checkpoint, data=data, workers=2, batch_size=4, order="given")
    with pytest.raises(RunError, match=r"rank 1 .*died") as info:
        recalibrate(request, settings)
    assert info.value.rank == 1


def test_a_stuck_rank_times_out_naming_it(settings, tmp_path):
    checkpoint, data = marked_data(tmp_path)
    request = RecalibrationRequest(
        arch="tests.nets:marker_net", checkpoint=checkpoint, data=data, workers=2, batch_size=4, order="given",
        model_kwargs={"action": "hang"},
    )
    quick = settings.model_copy(update={"collective_timeout_s": 4.0})
    with pytest.raises(RunError, match=r"rank 1 .*no progress for 4 s") as info:
        recalibrate(request, quick)
    assert info.value.rank == 1


def test_cancel_stops_the_job(mixed, settings):
    _, _, checkpoint, data = mixed
    cancel = threading.Event()
    request = RecalibrationRequest(arch="tests.nets:mixed_net", checkpoint=checkpoint, data=data, workers=2, batch_size=1)
    cancel.set()
    with pytest.raises(CancelledError):
        recalibrate(request, settings, cancel=cancel)


@pytest.mark.parametrize("layout", ["nested-ddp", "safetensors"])
def test_uploaded_format_and_layout_survive(mixed, settings, tmp_path, layout, warm_pool):
    from safetensors.torch import load_file, save_file

    model, _, _, data = mixed
    state = model.state_dict()
    if layout == "nested-ddp":
        source = tmp_path / "in.pt"
        torch.save({"model": {f"module.{k}": v for k, v in state.items()}, "epoch": 7, "note": "swa"}, source)
    else:
        source = tmp_path / "in.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, source, metadata={"origin": "test"})
    result = run(settings, source, data, warm_pool, workers=2, batch_size=8)
    out = tmp_path / ("out.pt" if layout == "nested-ddp" else "out.safetensors")
    result.save_model(out)
    if layout == "nested-ddp":
        saved = torch.load(out, weights_only=True)
        assert saved["epoch"] == 7 and saved["note"] == "swa"
        before, after = {k[7:]: v for k, v in torch.load(source, weights_only=True)["model"].items()}, {
            k[7:]: v for k, v in saved["model"].items()
        }
        assert all(k.startswith("module.") for k in saved["model"])
    else:
        from safetensors import safe_open

        before, after = load_file(source), load_file(out)
        with safe_open(out, "pt") as handle:
            assert handle.metadata() == {"origin": "test"}
    assert before.keys() == after.keys()
    for key in before:
        changed = key.endswith(("running_mean", "running_var", "num_batches_tracked"))
        assert torch.equal(before[key], after[key]) != changed, key
        assert before[key].dtype == after[key].dtype


def test_retry_policy_reruns_a_failed_pass_from_scratch(settings, tmp_path):
    checkpoint, data = marked_data(tmp_path)
    kwargs = {"action": "exit_once", "signal_dir": str(tmp_path)}
    request = RecalibrationRequest(
        arch="tests.nets:marker_net", checkpoint=checkpoint, data=data, workers=2, batch_size=4,
        model_kwargs=kwargs, max_retries=1,
    )
    result = recalibrate(request, settings)
    assert result.report["attempts"] == 2
    assert "rank 1" in result.report["retried_failures"][0]
    assert result.report["samples"] == 40  # the whole pass again, not a resumed one
    (tmp_path / "failed-once").unlink()
    request.max_retries = None  # the setting's default: off
    with pytest.raises(RunError, match="rank 1"):
        recalibrate(request, settings)


def test_object_store_transport_matches_shared_paths(mixed, settings, warm_pool):
    model, samples, checkpoint, data = mixed
    shipped = settings.model_copy(update={"data_transport": "object_store"})
    result = run(shipped, checkpoint, data, warm_pool, workers=2, batch_size=6)
    assert result.report["data_transport"] == "object_store"
    assert_matches_reference(result.model, reference_statistics(model, in_contract_order(samples), 6))


def cancel_after(cancel: threading.Event, seconds: float) -> float:
    """Set ``cancel`` after ``seconds`` from a timer thread; returns the monotonic time it fires."""
    import time

    threading.Timer(seconds, cancel.set).start()
    return time.monotonic() + seconds


@pytest.mark.parametrize("state", ["waiting for placement", "starting workers"])
def test_cancel_is_honoured_while_the_job_waits_and_frees_everything(mixed, settings, state):
    import time

    import ray
    from ray.util.placement_group import placement_group_table

    _, _, checkpoint, data = mixed
    if state == "waiting for placement":  # asks for more CPUs than the cluster has: the group stays pending
        settings = settings.model_copy(update={"cpus_per_worker": 1000.0, "placement_timeout_s": 60})
        arch = "tests.nets:mixed_net"
    else:  # placed, but every rank is still building its model
        arch = "tests.nets:slow_start_net"
    request = RecalibrationRequest(arch=arch, checkpoint=checkpoint, data=data, workers=2, batch_size=4)
    cpus = ray.available_resources().get("CPU", 0)
    groups_before = set(placement_group_table())  # a server of the session may keep warm gangs
    cancel = threading.Event()
    fired = cancel_after(cancel, 2.0)
    with pytest.raises(CancelledError):
        recalibrate(request, settings, cancel=cancel)
    assert time.monotonic() - fired < 2.0
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) >= cpus  # actors and bundles given back
    assert all(g["state"] == "REMOVED" for k, g in placement_group_table().items() if k not in groups_before)
