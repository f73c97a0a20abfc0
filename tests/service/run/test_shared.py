"""Runs that share ranks (``service.run.shared``): the second run over the same photos reads
them as the first decoded them, to the same statistics; each run's own ``close`` keeps the
ranks and what they kept, and ``finish`` ends it all once."""

from __future__ import annotations

import torch

from bnrecal.service.run.core import KeepBudget
from bnrecal.service.run.executors import InProcess
from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate
from bnrecal.service.run.shared import SharedRanks
from bnrecal.workers.data.reading.kept import KeptCounts
from tests.conftest import save_state
from tests.nets import classifier_net, perturbed
from tests.shards import photos, write_folder


def test_a_second_run_reads_what_the_first_decoded_and_finish_ends_it_once(tmp_path, settings):
    folder = write_folder(tmp_path / "photos", photos(12, size=40))
    request = RecalibrationRequest(
        arch="tests.nets:classifier_net", model_kwargs={"classes": 3}, batch_size=4, data=folder,
        transform={"resize": 20, "crop": 16}, checkpoint=save_state(tmp_path / "m.pt", perturbed(classifier_net(3))),
    )
    alone = recalibrate(request, settings, in_process=True)
    shared = SharedRanks(InProcess(), KeepBudget(2**26, 0))
    first = recalibrate(request, settings, in_process=True, shared=shared)
    second = recalibrate(request, settings, in_process=True, shared=shared)
    for result in (first, second):
        assert result.report.decoding is None  # the sweep's, not a cell's
        for key, value in alone.updates.items():
            assert torch.equal(result.updates[key], value), key
    counts = shared.finish()
    assert (counts.decoded, counts.reused) == (12, 12)  # the second run decoded nothing
    assert counts.memory_bytes == 12 * 3 * 16 * 16
    assert shared.finish() == counts and shared.release_decoded(shared.scope) == KeptCounts()


def test_the_next_models_export_reuses_the_trace_kept_for_the_scope_and_finish_drops_it(tmp_path, settings, monkeypatch):
    """A sweep's exports keep their trace under its scope (``workers.ranks.process.scoped``): the
    second checkpoint of the same architecture is not traced again, its file is byte for byte
    the file of its own single run, and ``finish`` drops the trace."""
    import bnrecal.service.export.folded_onnx as folded_onnx
    from bnrecal.service.run.outputs.later_phases import RunOutputs
    from bnrecal.workers.ranks.process.scoped import object_scopes

    traces: list[str] = []
    real = folded_onnx.export_unfolded
    monkeypatch.setattr(folded_onnx, "export_unfolded", lambda *a, **k: traces.append("trace") or real(*a, **k))
    folder = write_folder(tmp_path / "photos", photos(12, size=40))
    requests = []
    for seed in range(2):
        torch.manual_seed(seed)
        requests.append(RecalibrationRequest(
            arch="tests.nets:classifier_net", model_kwargs={"classes": 3}, batch_size=4, data=folder,
            transform={"resize": 20, "crop": 16},
            checkpoint=save_state(tmp_path / f"m{seed}.pt", perturbed(classifier_net(3), seed)),
        ))
    shared = SharedRanks(InProcess(), KeepBudget(2**26, 0))
    for number, request in enumerate(requests):
        recalibrate(request, settings, in_process=True, shared=shared,
                    outputs=RunOutputs(onnx=tmp_path / f"cell{number}.onnx"))
    assert len(traces) == 1 and shared.scope in object_scopes()
    shared.finish()
    assert shared.scope not in object_scopes()
    recalibrate(requests[1], settings, in_process=True, outputs=RunOutputs(onnx=tmp_path / "alone.onnx"))
    assert len(traces) == 2  # a run of its own traces its model, and keeps nothing after it
    assert (tmp_path / "cell1.onnx").read_bytes() == (tmp_path / "alone.onnx").read_bytes()
    assert (tmp_path / "cell1.onnx").read_bytes() != (tmp_path / "cell0.onnx").read_bytes()
    assert object_scopes() == []


def test_a_set_is_described_and_its_labels_and_probes_read_once_for_every_run(tmp_path, settings, monkeypatch):
    """The host's reading of a set (listing it, its evaluation labels, the first sample each
    run probes with) is the sweep's once, not each cell's; each run's evaluation is the same."""
    import bnrecal.service.run.recalibrate as recalibrate_module
    import bnrecal.service.run.request as recalibration_module

    calls: list[str] = []

    def counted(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls.append(name) or real(*a, **k))

    counted(recalibrate_module, "describe_dataset")
    counted(recalibration_module, "describe_dataset")
    counted(recalibration_module, "read_labels")
    folder = write_folder(tmp_path / "photos", photos(12, size=40))
    requests = []
    for seed in range(2):
        torch.manual_seed(seed)
        requests.append(RecalibrationRequest(
            arch="tests.nets:classifier_net", model_kwargs={"classes": 3}, batch_size=4, data=folder, eval_data=folder,
            transform={"resize": 20, "crop": 16},
            checkpoint=save_state(tmp_path / f"m{seed}.pt", perturbed(classifier_net(3), seed)),
        ))
    shared = SharedRanks(InProcess(), KeepBudget(2**26, 0))
    cells = [recalibrate(request, settings, in_process=True, shared=shared) for request in requests]
    shared.finish()
    assert sorted(calls) == ["describe_dataset", "describe_dataset", "read_labels"]
    alone = recalibrate(requests[1], settings, in_process=True)
    mine, theirs = (result.report.evaluation.model_dump(exclude={"seconds"}) for result in (cells[1], alone))
    assert mine == theirs and mine["labelled"] and mine["samples"] == 12
