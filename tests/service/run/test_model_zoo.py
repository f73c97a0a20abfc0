"""The model zoos users bring (torchvision here, timm in ``test_model_zoo_timm.py``), calibrated by two rank actors over the
real GLOO collective in sync and local mode, each checked against the independent float64
reference (each BN module's own forward in train mode), then exported folded to ONNX and
verified in onnxruntime. Each model also goes through as a ``torch.export`` program (no
architecture code on the ranks) and must give the eager model's statistics. Deep in these random-weight models a float32 forward rounds by
more than 1e-4 on its own, so a layer there is held to a small multiple of what torch's
own float32 training-mode BN is off by (``assert_matches_reference``).

Two long-lived actors run the engine's own rank loop (``calibration_pass``) for every
model, so the sweep pays Ray's actor start-up once, not once per model and mode; the
job path around it (placement, streaming, the CLI) is tested on small nets elsewhere.
Each rank runs its calls in the order they come, so a model's passes are all started at
once and this process works while the ranks calibrate: it exports the program, computes the
references and exports the folded ONNX model while the ranks are busy. A rank builds its
model on the meta device (``skeleton``): the state dict it loads replaces every weight.
"""

from __future__ import annotations

import copy
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from bnrecal.workers.engine.batchnorm import find_batchnorm_layers
from bnrecal.workers.engine.statistics_pass import apply_statistics, calibration_pass
from bnrecal.workers.engine.moments import MomentStats
from bnrecal.workers.models.architectures import build_model
from bnrecal.workers.programs import load_program
from bnrecal.workers.ranks.process.ray_collective import RayCollective
from bnrecal.workers.ranks.sharding import rank_ranges

from bnrecal.service.export import export_folded_onnx

from tests.programs import export_program
from tests.reference import assert_matches_reference, reference_statistics
from tests.service.export.helpers import assert_matches_torch, op_counts
from tests.zoo import TORCHVISION, ZooCase, stale

pytestmark = pytest.mark.usefixtures("ray_cluster")

WORLD = 2
BATCH = 6
LAYOUTS = {"sync": "channels_last", "local": "contiguous"}
"""The layout each mode computes in (the statistics do not depend on it; both are covered)."""


def skeleton(case: ZooCase) -> torch.nn.Module:
    """The architecture with uninitialised weights, for a state dict to overwrite: built on the
    meta device and given empty CPU storage, so a rank does not pay the random initialisation
    the driver already paid. A model with non-persistent buffers (computed at build time, not
    in its state dict) is built normally."""
    try:
        with torch.device("meta"):
            model = build_model(case.arch, case.kwargs, device="meta")
    except Exception:  # noqa: BLE001 - an architecture that cannot be built on meta
        return build_model(case.arch, case.kwargs)
    saved = model.state_dict(keep_vars=True)
    if any(name not in saved for name, _ in model.named_buffers(remove_duplicate=False)):
        return build_model(case.arch, case.kwargs)
    return model.to_empty(device="cpu")


@ray.remote(num_cpus=1)
class ZooRank:
    """One rank of the sweep: joins the group once, then calibrates model after model."""

    def __init__(self, rank: int) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.collective: RayCollective | None = None

    def join(self, group: str) -> None:
        """Join the sweep's GLOO group (every rank at once)."""
        self.collective = RayCollective(WORLD, self.rank, "gloo", group)

    def calibrate(self, case: ZooCase, state: dict[str, torch.Tensor], samples: torch.Tensor, mode: str) -> Any:
        """This rank's share of one calibration; rank 0 returns every layer's statistics.

        Each mode runs in one layout (``LAYOUTS``), so both are covered and a program replays
        exactly the kernels of its model's sync pass: the same rounding, the same statistics."""
        model = skeleton(case)
        model.load_state_dict(state)
        layers, _ = find_batchnorm_layers(model)
        ranges = rank_ranges(len(samples), BATCH, WORLD, self.rank)
        result = calibration_pass(
            model, layers, [samples[a:b] for a, b in ranges], mode=mode, collective=self.collective,
            memory_format=LAYOUTS[mode],
        )
        return [(s.count, s.mean, s.var) for s in result.stats], result.steps

    def calibrate_program(self, archive: bytes, samples: torch.Tensor, mode: str) -> Any:
        """This rank's share of a program's calibration; rank 0 returns each layer's name and statistics."""
        program = load_program(archive, "zoo.pt2")
        layers, _ = find_batchnorm_layers(program)
        ranges = rank_ranges(len(samples), BATCH, WORLD, self.rank)
        result = calibration_pass(
            program, layers, [samples[a:b] for a, b in ranges], mode=mode, collective=self.collective,
            memory_format=LAYOUTS[mode],
        )
        return {layer.name: (s.count, s.mean, s.var) for layer, s in zip(layers, result.stats)}, result.steps

    def leave(self) -> None:
        """Leave the group."""
        if self.collective is not None:
            self.collective.close()


@pytest.fixture(scope="module")
def ranks() -> Iterator[list[Any]]:
    actors = [ZooRank.remote(rank) for rank in range(WORLD)]
    group = f"zoo-{uuid.uuid4().hex[:8]}"
    ray.get([actor.join.remote(group) for actor in actors])
    yield actors
    ray.get([actor.leave.remote() for actor in actors])
    for actor in actors:
        ray.kill(actor)


def calibrate_on_ranks(ranks: list[Any], case: ZooCase, state: Any, data: Any, mode: str) -> list[Any]:
    """Start one calibration on the ranks (``state`` and ``data``: the model's state dict and the
    samples in the object store, put once per model); :func:`calibrated_model` waits for it.
    Each rank runs its calls in the order they were made, so the driver works meanwhile."""
    return [rank.calibrate.remote(case, state, data, mode) for rank in ranks]


def calibrated_model(model: torch.nn.Module, pending: list[Any]) -> torch.nn.Module:
    """A copy of ``model`` with the statistics rank 0 returned for ``pending``."""
    (stats, steps), _ = ray.get(pending)
    calibrated = copy.deepcopy(model)
    layers, _ = find_batchnorm_layers(calibrated)
    unreached = apply_statistics(layers, [MomentStats(*s) for s in stats], steps)
    assert unreached == []
    return calibrated


def program_on_ranks(ranks: list[Any], model: torch.nn.Module, samples: torch.Tensor, data: Any, tmp_path: Path):
    """The model exported with a dynamic batch, calibrated in sync mode by the ranks from
    its archive alone, in the layout of the model's own sync pass; the archive and the pending
    pass (each layer's statistics and the steps)."""
    path = export_program(model, samples[:2], tmp_path / "zoo.pt2", dynamic=True)
    archive = ray.put(path.read_bytes())
    return path, [rank.calibrate_program.remote(archive, data, "sync") for rank in ranks]


def assert_same_statistics(program_stats: dict[str, Any], eager: torch.nn.Module, rel: float = 1e-5) -> None:
    """The program's statistics are the eager model's, layer by layer, to ``rel``."""
    modules = dict(eager.named_modules())
    eager_layers = {layer.name for layer in find_batchnorm_layers(eager)[0]}
    assert set(program_stats) == eager_layers
    for name, (count, mean, var) in program_stats.items():
        got = MomentStats(count, mean, var)
        module = modules[name]
        std = module.running_var.double().sqrt().clamp_min(1e-30)
        assert ((got.mean - module.running_mean.double()).abs() / std).max() <= rel, name
        assert ((got.unbiased_var - module.running_var.double()).abs() / std**2).max() <= rel, name


def sweep(ranks: list[Any], case: ZooCase, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = stale(build_model(case.arch, case.kwargs))
    samples = torch.randn(case.samples, 3, case.size, case.size) * 1.2 + 0.1
    state, data = ray.put(model.state_dict()), ray.put(samples)
    modes = ("sync", "local") if case.local else ("sync",)
    # The ranks calibrate while this process exports the program and computes the references.
    pending = {mode: calibrate_on_ranks(ranks, case, state, data, mode) for mode in modes}
    path, program_pending = program_on_ranks(ranks, model, samples, data, tmp_path)
    expected = {mode: reference_statistics(model, samples, BATCH, world_size=WORLD, mode=mode) for mode in modes}
    results = {}
    for mode in modes:
        results[mode] = calibrated_model(model, pending[mode])
        try:
            assert_matches_reference(results[mode], expected[mode])
        except AssertionError:  # deep in a random-weight net: held to torch's own float32 drift there
            float32 = reference_statistics(model, samples, BATCH, world_size=WORLD, mode=mode, dtype=torch.float32)
            assert_matches_reference(results[mode], expected[mode], float32_reference=float32)
    if case.export:  # while the ranks calibrate the program
        check_folded_export(case, results["sync"], samples, tmp_path / "model.onnx")
    (program_stats, steps), _ = ray.get(program_pending)
    assert_same_statistics(program_stats, results["sync"])
    if case.program_export:
        program = load_program(path)
        layers, _ = find_batchnorm_layers(program)
        assert apply_statistics(layers, [MomentStats(*program_stats[layer.name]) for layer in layers], steps) == []
        out = tmp_path / "program.onnx"
        report = export_folded_onnx(program, samples[:4], out)
        assert report["folded"] > 0 and report["batch"] == "dynamic"
        assert_matches_torch(out, results["sync"], samples[4:7])


def check_folded_export(case: ZooCase, calibrated: torch.nn.Module, samples: torch.Tensor, out: Path) -> None:
    """The calibrated model exported folded to ONNX: what folds, what stays and why, and its outputs."""
    report = export_folded_onnx(calibrated, samples[:4], out)
    batchnorms = len(find_batchnorm_layers(calibrated)[0])
    assert report["folded"] + report["batchnorm_nodes"] >= batchnorms
    assert report["folded"] > 0 and report["verified_batches"] == [1, 4]
    if case.unfolded is not None:  # every BN after a conv folds; the rest are named, with their reason
        assert (report["folded"], report["batchnorm_nodes"]) == (batchnorms - case.unfolded, case.unfolded)
        assert op_counts(out).get("BatchNormalization", 0) == case.unfolded
        assert all(re.fullmatch(case.unfolded_names, u["name"]) for u in report["unfolded"]), report["unfolded"]
        assert all("is not Conv" in u["reason"] for u in report["unfolded"])
    assert_matches_torch(out, calibrated, samples[4:7])


@pytest.mark.parametrize("case", [c.param() for c in TORCHVISION])
def test_torchvision_zoo(ranks, case, tmp_path):
    sweep(ranks, case, tmp_path)
