"""onnxruntime passes on real Ray ranks (``workers.ranks.ort.rank_pass``, ``onnx_group``): the INT8
file byte for byte the same for K = 1, 2, 4 (a rank with an empty shard at the last step) and
in one process; scores equal to the models' own PyTorch answers counted here (an independent
reference), on all samples and on the guard's two parts; the evaluation before and after
equal to the engine's PyTorch evaluation of the same models; one collective per read; a
pass over the samples in another order (the calibration order) finding each sample's label
and part by its evaluation position; a lost rank re-running that pass only."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torchvision

from bnrecal.workers.data import iter_batches
from bnrecal.workers.data.reading.alignment import positions_in
from bnrecal.workers.engine.collective import SingleProcessCollective
from bnrecal.workers.engine.evaluation import EvalTarget, check_eval_output, evaluation_pass
from bnrecal.workers.ranks.group import GroupOptions
from bnrecal.workers.ranks.ort.group import run_onnx_pass_group
from bnrecal.workers.ranks.ort.rank_pass import Comparison, OnnxPassRequest, PassModel, onnx_pass
from bnrecal.workers.ranks.plan import EvalPlan
from bnrecal.workers.ranks.sharding import rank_ranges

from bnrecal.service.export.int8.checks import LabelledBatches
from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.export.int8.quantizer import prepare, tensors_data, write_qdq
from bnrecal.service.run.outputs.int8 import range_request
from bnrecal.service.run.outputs.onnx_passes import InProcessPasses
from tests.service.export.int8_helpers import array_dataset, fp32_export

SAMPLES, BATCH, CLASSES = 41, 16, 10  # the last step has one sample: ranks 1..K-1 take an empty slice


def on_ranks(request, dataset, world, pool):
    return run_onnx_pass_group(request, dataset, BATCH, world, "cpu", "gloo", GroupOptions(cpus_per_worker=1),
                               pool=pool)


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_int8_file_is_byte_identical_for_any_number_of_ranks(scored, warm_pool, method):
    _, _, _, exports, _, dataset = scored  # the first resnet18's export, on its 41 samples
    prepared = prepare(exports[0])
    options = Int8Options(method=method)
    request = OnnxPassRequest((PassModel(prepared.model, range_request(prepared, options)),))

    def file_of(result) -> bytes:
        found = result.models[0]
        return write_qdq(prepared, tensors_data(found.ranges, found.histograms, found.edges, options), options, [])

    here = InProcessPasses(dataset, BATCH).over_calibration(request.models).result
    files = {0: file_of(here)}
    reads = 1 if method == "minmax" else 2
    for world in (1, 2, 4):
        gathered = on_ranks(request, dataset, world, warm_pool)
        assert gathered.collectives == [reads] * world
        assert sum(gathered.samples) == SAMPLES
        assert np.array_equal(gathered.result.models[0].ranges.low, here.models[0].ranges.low)
        if here.models[0].histograms is not None:
            assert np.array_equal(gathered.result.models[0].histograms, here.models[0].histograms)
        files[world] = file_of(gathered.result)
    assert len(set(files.values())) == 1


def torch_counts(model: torch.nn.Module, samples: torch.Tensor, labels: np.ndarray, keep: np.ndarray) -> tuple[int, int]:
    """Top-1 and top-5 right answers of the PyTorch model itself on the kept samples."""
    with torch.no_grad():
        logits = model.eval()(samples[torch.from_numpy(keep)])
    top5 = logits.topk(5, dim=1).indices.numpy()
    kept = labels[keep]
    return int((top5[:, 0] == kept).sum()), int((top5 == kept[:, None]).any(axis=1).sum())


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """Two resnet18 (random weights) at 24x24, their FP32 exports, 41 samples saved as
    calibration data and labels: exported once for every test here that needs a model."""
    tmp = tmp_path_factory.mktemp("scores")
    torch.manual_seed(0)
    first, second = torchvision.models.resnet18(num_classes=CLASSES), torchvision.models.resnet18(num_classes=CLASSES)
    samples = torch.randn(SAMPLES, 3, 24, 24)
    models = [fp32_export(first, samples, tmp / "a.onnx"), fp32_export(second, samples, tmp / "b.onnx")]
    with torch.no_grad():  # labels the first model gets right about half the time: the counts are not trivial
        guesses = first.eval()(samples).argmax(1).numpy()
    labels = np.where(np.arange(SAMPLES) % 2 == 0, guesses, (guesses + 1) % CLASSES).astype(np.int64)
    return first, second, samples, models, labels, array_dataset(tmp / "x.npy", samples)


@pytest.mark.parametrize("part", ["all", "even", "odd"])
def test_scores_match_the_models_own_answers_for_any_number_of_ranks(scored, warm_pool, part):
    first, second, samples, models, labels, dataset = scored
    positions = np.arange(SAMPLES)
    parts = {"all": np.ones(SAMPLES, bool), "even": positions % 2 == 0, "odd": positions % 2 == 1}
    request = OnnxPassRequest(tuple(PassModel(m) for m in models), labels, part=part)
    covered = ["all", "even", "odd"] if part == "all" else [part]
    for world in (1, 2, 4):
        group = on_ranks(request, dataset, world, warm_pool)
        assert group.collectives == [1] * world and sum(group.samples) == SAMPLES
        for name in covered:  # a pass over every sample scores each part in the same read
            expected = [torch_counts(net, samples, labels, parts[name]) for net in (first, second)]
            got = [group.result.scores(i, name) for i in (0, 1)]
            assert [(round(g["top1"] * g["samples"]), round(g["top5"] * g["samples"])) for g in got] == expected
            assert got[0]["samples"] == int(parts[name].sum())
    if part != "all":  # the selection part's pass ran half the samples: it has nothing to say of the rest
        with pytest.raises(ValueError, match="no scores"):
            group.result.scores(0, "all")


def test_the_comparison_is_the_engines_evaluation_of_the_same_models(scored, warm_pool):
    """The evaluation before and after, measured in onnxruntime on the two exports, gives the
    figures the engine's PyTorch evaluation gives on the models themselves (the exports
    agree with them to float rounding), for any number of ranks."""
    first, second, samples, models, labels, dataset = scored
    target = check_eval_output(first, samples[:1], labels)
    batches = [samples[i : i + BATCH] for i in range(0, SAMPLES, BATCH)]
    reference, _ = evaluation_pass(first, second, batches, [labels[i : i + BATCH] for i in range(0, SAMPLES, BATCH)],
                                   target, collective=SingleProcessCollective())
    request = OnnxPassRequest(tuple(PassModel(m) for m in models), labels, compare=Comparison(0, 1, target))
    for world in (1, 2, 4):
        measured = on_ranks(request, dataset, world, warm_pool).result.evaluation
        assert measured.samples == reference.samples == SAMPLES
        for key in ("before", "after"):
            got, expected = getattr(measured, key), getattr(reference, key)
            assert got.top1 == expected.top1 and got.top5 == expected.top5
            assert got.cross_entropy == pytest.approx(expected.cross_entropy, rel=1e-4)
        assert measured.prediction_change == reference.prediction_change
        assert measured.kl_divergence == pytest.approx(reference.kl_divergence, rel=1e-3, abs=1e-6)


def test_a_pass_in_another_order_scores_by_evaluation_position(scored):
    """The calibration data given again as evaluation data: a pass over the samples in the
    calibration's shuffled order, told each one's evaluation position, scores every part
    exactly as a pass over the evaluation order."""
    _, _, _, models, labels, dataset = scored
    shuffled = replace(dataset, order="shuffled", seed=3)
    positions = positions_in(shuffled, SAMPLES, dataset)
    assert positions is not None and sorted(positions.tolist()) == list(range(SAMPLES))
    assert not np.array_equal(positions, np.arange(SAMPLES))
    assert positions_in(shuffled, SAMPLES - 1, dataset) is None  # a prefix is not all of them

    def run(spec, request):
        ranges = rank_ranges(SAMPLES, BATCH, 1, 0)
        with spec.open() as data:
            return onnx_pass(request, ranges, lambda: iter_batches(data, ranges), SingleProcessCollective(), 0)

    straight = run(dataset, OnnxPassRequest(tuple(PassModel(m) for m in models), labels))
    crossed = run(shuffled, OnnxPassRequest(tuple(PassModel(m) for m in models), labels[positions], positions))
    for part in ("all", "even", "odd"):
        assert [crossed.scores(i, part) for i in (0, 1)] == [straight.scores(i, part) for i in (0, 1)], part


def test_held_batches_score_the_same_parts(scored):
    """The Python API scores evaluation batches it holds: the same figures on each part."""
    _, _, samples, models, labels, dataset = scored
    held = LabelledBatches([samples[i : i + 7].numpy() for i in range(0, SAMPLES, 7)],
                           [labels[i : i + 7] for i in range(0, SAMPLES, 7)])
    described = EvalPlan(dataset, labels, EvalTarget(CLASSES, (CLASSES,), True), BATCH)
    pass_models = [PassModel(m) for m in models]
    from_held = InProcessPasses(dataset, BATCH, evaluation=held).over_evaluation(pass_models).result
    from_file = InProcessPasses(dataset, BATCH, evaluation=described).over_evaluation(pass_models).result
    for part in ("all", "even", "odd"):
        assert [from_held.scores(i, part) for i in (0, 1)] == [from_file.scores(i, part) for i in (0, 1)], part


def _pass_rank_pids() -> set[int]:
    """Rank processes of this test process's Ray now running an ONNX pass (Ray titles an
    actor process by its method); another test run's ranks on the machine are not ours."""
    import psutil

    pids = set()
    for process in psutil.Process().children(recursive=True):
        try:
            if any("CalibrationRank.onnx_pass" in part for part in process.cmdline()):
                pids.add(process.pid)
        except psutil.Error:  # ended meanwhile
            pass
    return pids


def test_a_rank_lost_in_a_range_pass_reruns_that_pass_only_and_gives_the_same_ranges(tmp_path, ray_cluster):
    """A rank killed while it gathers INT8 ranges: the pass runs again under the run's failure
    policy (the calibration before it is not redone: this is the range pass alone), the
    ranges equal those of a pass that never failed, and the failure named its rank."""
    import os
    import signal
    import threading
    import time

    from bnrecal.service.run.core import FailurePolicy, RunControl
    from bnrecal.service.run.executors import on_ranks as passes_on_ranks
    from bnrecal.service.settings import Settings

    torch.manual_seed(1)
    model = torchvision.models.resnet18(num_classes=10)
    samples = torch.randn(480, 3, 64, 64)
    prepared = prepare(fp32_export(model, samples, tmp_path / "fp32.onnx"))
    dataset = array_dataset(tmp_path / "x.npy", samples)
    models = [PassModel(prepared.model, range_request(prepared, Int8Options()))]
    clean = InProcessPasses(dataset, 8).over_calibration(models).result

    control = RunControl(FailurePolicy(max_retries=1))
    failures = control.failures
    phases: list[str] = []
    passes = passes_on_ranks(dataset, 8, 2, "cpu", Settings(cpus_per_worker=1), control=control,
                             on_phase=phases.append)
    outcome: dict = {}
    worker = threading.Thread(target=lambda: outcome.update(result=passes.over_calibration(models)))
    worker.start()
    deadline = time.monotonic() + 120
    while not _pass_rank_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the ranks are gathering
    victim = sorted(_pass_rank_pids())[0]
    os.kill(victim, signal.SIGKILL)
    worker.join(timeout=300)
    assert "result" in outcome, "the range pass did not come back"
    assert len(failures) == 1 and "rank" in failures[0] and "INT8 ranges" in failures[0], failures
    assert phases and phases[0].startswith("running the INT8 ranges pass again after: rank"), phases
    ranges = outcome["result"].result.models[0].ranges
    assert np.array_equal(ranges.low, clean.models[0].ranges.low)
    assert np.array_equal(ranges.high, clean.models[0].ranges.high)


def test_a_slice_run_in_pieces_writes_the_same_file(scored, monkeypatch):
    """Ranks run their slice in pieces of about RUN_BYTES of outputs (page faults cost as much
    as the forward otherwise): pieces of two samples give the file whole slices give."""
    import bnrecal.workers.ranks.ort.pieces as onnx_pieces_module

    _, _, _, exports, _, dataset = scored  # the second resnet18's export, on the 41 samples
    prepared = prepare(exports[1])
    options = Int8Options()
    models = [PassModel(prepared.model, range_request(prepared, options))]

    def file_written() -> bytes:
        found = InProcessPasses(dataset, BATCH).over_calibration(models).result.models[0]
        return write_qdq(prepared, tensors_data(found.ranges, None, None, options), options, [])

    whole = file_written()
    monkeypatch.setattr(onnx_pieces_module, "RUN_BYTES", 1)  # every piece as small as it may be: two samples
    assert file_written() == whole
