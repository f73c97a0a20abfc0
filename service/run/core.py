"""The one run core: ``run(plan, executor)``, for the command line, the job server and the
Python API alike.

A :class:`RunPlan` says what a surface has prepared: the driver's model (its BN buffers
receive the statistics), how the ranks build it (a model source and the weights
that travel), the data, the evaluation, and the run options. An executor says where the
ranks run (``service.run.executors``): ``InProcess`` (one rank in the calling process, no
Ray) or ``RayRanks`` (a rank group on Ray, warm from a pool when there is one). A
:class:`FailurePolicy` decides whether a failed pass runs again. The core finds the BN
layers, checks the model on the first batch (its call order, what the evaluation can
measure: here, or on a sweep's ranks), runs the pass (statistics, and the evaluation after
them, fused on the ranks), writes the statistics into the driver's model
and builds the typed report (docs/report.md). What each surface does before (load a
checkpoint, ship a live model) and after (save, export, write back into a caller's
model) stays with the surface.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import torch
from torch import nn

from bnrecal.workers.data import DatasetSpec, discard_unpack
from bnrecal.workers.data.reading.kept import KeepDecoded, KeptCounts
from bnrecal.workers.data.formats.loader import LoaderSpec
from bnrecal.workers.engine.batchnorm import BatchNormLayer, SkippedLayer, require_batchnorm_layers
from bnrecal.workers.engine.statistics_pass import StopRule, apply_statistics
from bnrecal.errors import CallOrderError, CancelledError, DatasetError, RunError
from bnrecal.workers.models.sources import ModelSource
from bnrecal.workers.ranks.local import IN_PROCESS, check_model
from bnrecal.workers.ranks.plan import EvalPlan, GroupResult, ModelChecks, RankPlan

from bnrecal.service.run.options import STARTING_PHASE, RunOptions
from bnrecal.service.run.report import (
    PYTORCH_RUNTIME, DataSummary, DecodingReport, EvaluationSection, LayerDrift, Placement, Report, add_to_timeline,
    build_report, where_ranks_ran,
)

if TYPE_CHECKING:
    from bnrecal.service.run.onnx_passes import OnnxPasses, PassRecorder

ProgressCallback = Callable[[int, int | None, str], None]
"""Called with (samples done, samples total, phase): ``starting workers`` before each
attempt, then ``calibrating``, then ``evaluating`` when the plan evaluates; a later phase
that counts no samples (``exporting``, ``quantizing to INT8``, ...) with total None."""

log = logging.getLogger("bnrecal.run")

Feed = Callable[[nn.Module, Any], Any]
T = TypeVar("T")
Then = Callable[["RunResult", "Executor"], T]
"""What a surface makes of the finished statistics while the run's ranks are still up (its
export and INT8 file: ``service.run.outputs``), given them and the run's executor; ``run``
returns what it returns."""


@dataclass(frozen=True)
class KeepBudget:
    """What each rank may hold of the samples it decoded, for the run's later passes
    (docs/data.md, "Read once per job"): bytes of memory, then of local disk."""

    memory_bytes: int
    disk_bytes: int

    @classmethod
    def from_megabytes(cls, memory_mb: int, disk_mb: int) -> KeepBudget:
        """The budget of the settings ``kept_memory_mb`` and ``kept_disk_mb``."""
        return cls(memory_mb * 2**20, disk_mb * 2**20)


@dataclass(frozen=True)
class LaterPhases:
    """What the statistics' pass does for the run's later phases (the export and INT8 files).

    With ``keep`` the ranks keep the samples of the described data they decode for the
    later passes (the evaluation, the INT8 passes), within its budget; without it nothing is
    kept and nothing counted. ``head`` asks the ranks for the first samples of the order as
    they read them (an export's checks run on them, so the driver reads none); with
    ``evaluation_later`` the statistics' pass does not evaluate: a later phase measures the
    evaluation (the INT8 export's, on the folded FP32 models, in the pass that gathers their
    ranges)."""

    keep: KeepBudget | None = None
    head: int = 0
    evaluation_later: bool = False
    shared: SharedScope | None = None


@dataclass(frozen=True)
class SharedScope:
    """Samples kept beyond one run: a sweep's runs (``service.run.shared``) keep what their
    ranks decode under the sweep's ``scope``, each of its datasets named with ``suffix``
    (the calibration set's name), so the next model over the same set reads them decoded.
    The owner of the scope releases it, and reports what was decoded and reused."""

    scope: str
    suffix: str


@dataclass(frozen=True)
class RunPlan:
    """A recalibration as a surface prepared it.

    ``model`` is the driver's model: the core checks it (``_check_model``) and writes the new
    statistics into its BN buffers. ``source`` and ``weights`` are how the ranks build it
    (a Ray run puts ``weights`` in the object store once). ``probe`` is a batch of the
    first samples as the ranks feed it (through ``feed`` when given). ``label`` names the
    model in messages. ``release``, when given, runs once the ranks are done, before the
    statistics are written (a caller's own modules put back as they were). ``later`` is
    what the pass does for the phases after it (``LaterPhases``).
    """

    model: nn.Module
    source: ModelSource
    weights: Any
    label: str
    data: DatasetSpec | LoaderSpec
    probe: Any
    options: RunOptions
    evaluation: EvalPlan | None = None
    feed: Feed | None = None
    memory_format: str = "auto"
    release: Callable[[], None] | None = None
    later: LaterPhases = LaterPhases()

    def datasets(self) -> list[DatasetSpec | LoaderSpec]:
        """The data the run reads: calibration, then evaluation."""
        return [self.data] + ([self.evaluation.dataset] if self.evaluation is not None else [])


@dataclass
class RunResult:
    """A finished run: the driver's calibrated layers (their buffers hold the new
    statistics), the statistics as they were before, and the report."""

    report: Report
    calibrated: list[BatchNormLayer]
    stale_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    data: DatasetSpec | LoaderSpec | None = None
    evaluation: EvalPlan | None = None
    """The run's data and evaluation as its passes read them (marked to be kept on the
    ranks): what a later phase reads again."""
    head: torch.Tensor | None = None
    """The first samples of the order as the ranks read them (``LaterPhases.head``)."""
    scope: str | None = None
    """The run's scope on its ranks (a sweep's, when shared): what its later phases keep
    there between calls lives under it (``workers.ranks.scoped``)."""

    @property
    def updates(self) -> dict[str, torch.Tensor]:
        """The checkpoint entries the run changed, keyed by model key."""
        return bn_buffer_updates(self.calibrated)


class FailureDecision(Enum):
    """What the policy decided for a failed pass."""

    RETRY = "retry"
    RAISE = "raise"


@dataclass(frozen=True)
class FailurePolicy:
    """Whether a failed pass on the ranks runs again (docs/calibration.md, "Faults and
    retries"): a lost rank or a timed-out collective is retried up to ``max_retries``
    times, from the start of the pass; bad input, a call order that differs between ranks
    (it would differ again) and a cancellation never are."""

    max_retries: int = 0

    def make_decision(self, error: BaseException, failures: Sequence[str]) -> FailureDecision:
        """RETRY while retries are left for a failure a new attempt can cure, else RAISE."""
        if not isinstance(error, RunError) or isinstance(error, (CancelledError, CallOrderError)):
            return FailureDecision.RAISE
        return FailureDecision.RETRY if len(failures) < self.max_retries else FailureDecision.RAISE


class Executor(Protocol):
    """Where the ranks of a run execute."""

    def start(self, plan: RunPlan) -> None:
        """Make the ranks' world ready (start or join Ray); called once per run."""

    def rank_plan(self, plan: RankPlan) -> RankPlan:
        """The rank plan completed with what only the executor knows (backend, loaders)."""

    def execute(
        self, plan: RankPlan, run: RunPlan, on_progress: Callable[[str, int], None], cancel: threading.Event | None
    ) -> GroupResult:
        """One attempt of the pass; raises a ``RunError`` when a rank fails."""

    def placement(self, run: RunPlan) -> Placement:
        """Where and how the ranks ran, for the report."""

    def release_decoded(self, scope: str) -> KeptCounts:
        """The run is over: the ranks drop the samples they kept for ``scope``; what its
        passes decoded and reused (idempotent: zeros the second time)."""

    def onnx_passes(self, dataset: DatasetSpec, batch_size: int, samples: int, evaluation: EvalPlan | None, *,
                    policy: FailurePolicy, failures: list[str], on_phase: Callable[[str], None] | None,
                    cancel: threading.Event | None, record: PassRecorder | None) -> OnnxPasses:
        """Where the run's onnxruntime passes run, on its ranks: over the first ``samples`` of
        ``dataset`` with the calibration's sharding, and over the evaluation data."""

    def map(self, work: Callable[..., T], calls: Sequence[tuple[Any, ...]], *, policy: FailurePolicy,
            failures: list[str], on_phase: Callable[[str], None] | None, cancel: threading.Event | None) -> list[T]:
        """``work(*args)`` for each of ``calls`` where the ranks run, spread over them (a later
        phase's own computing: the exports), retried under ``policy``; results in order."""

    def close(self) -> None:
        """Stop what ``start`` started for this run only."""


@overload
def run(plan: RunPlan, executor: Executor, *, policy: FailurePolicy | None = ..., on_progress: ProgressCallback | None = ...,
        cancel: threading.Event | None = ..., then: None = ...) -> RunResult: ...


@overload
def run(plan: RunPlan, executor: Executor, *, policy: FailurePolicy | None = ..., on_progress: ProgressCallback | None = ...,
        cancel: threading.Event | None = ..., then: Then[T]) -> T: ...


def run(
    plan: RunPlan,
    executor: Executor,
    *,
    policy: FailurePolicy | None = None,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    then: Then[Any] | None = None,
) -> Any:
    """Recompute every BN layer's running statistics of ``plan.model`` on the executor's
    ranks (docs/calibration.md) and evaluate when the plan says so; return the result with
    the report, or, given ``then`` (the export and INT8 files: ``service.run.outputs``),
    what ``then`` makes of it on the same executor while its ranks are up."""
    options = plan.options
    shared = plan.later.shared
    scope = shared.scope if shared is not None else uuid.uuid4().hex
    plan = _kept(plan, scope)
    try:
        try:
            layers, skipped = require_batchnorm_layers(plan.model, plan.label)
            plan, call_order, checks = _check_model(plan, layers)
            old = [(layer.running_mean.clone(), layer.running_var.clone()) for layer in layers]
            stale = {key: value.clone() for key, value in bn_buffer_updates(layers).items()}
            executor.start(plan)
            rank_plan = executor.rank_plan(RankPlan(
                model=plan.source, dataset=plan.data, batch_size=options.batch_size, mode=options.mode,
                world_size=options.workers, device=options.device, backend=IN_PROCESS, group_name="",
                layer_names=tuple(layer.name for layer in layers), call_order=call_order,
                memory_format=plan.memory_format, evaluation=None if plan.later.evaluation_later else plan.evaluation,
                feed=plan.feed, stop=StopRule(options.stop_tolerance) if options.auto_samples else None, head=plan.later.head,
                checks=checks,
            ))
            started = time.monotonic()
            result, failures = _attempts(plan, executor, rank_plan, policy or FailurePolicy(), on_progress, cancel)
            wall = time.monotonic() - started
            if plan.evaluation is not None and plan.evaluation.target is None:  # the ranks decided it
                if result.eval_target is None:
                    raise RunError("the ranks did not say what the evaluation measures")
                plan = replace(plan, evaluation=replace(plan.evaluation, target=result.eval_target, probe=None))
            placement = executor.placement(plan)
        finally:
            if plan.release is not None:
                plan.release()
        finished = _finish(plan, layers, skipped, old, stale, result, placement, failures)
        finished.scope = scope
        _time_the_pass(finished.report, plan, result, wall, len(failures) + 1)
        made: Any = finished
        if then is not None:  # on the same executor, while its world is up
            check_cancel(cancel)
            made = then(finished, executor)
        if plan.later.keep is not None and shared is None:  # a shared scope's owner reports its decoding
            finished.report.decoding = decoding_report(executor.release_decoded(scope), plan.later.keep)
        return made
    finally:
        try:
            executor.release_decoded(scope)
        finally:
            executor.close()


def _check_model(plan: RunPlan, layers: list[BatchNormLayer]) -> tuple[RunPlan, tuple[int, ...], ModelChecks | None]:
    """Check that the model runs on the data, find its BN layers' call order on the probe
    and what its evaluation can measure (the evaluation's ``target``), where it costs least
    (docs/sweeps.md, "What is shared"): here, before any rank starts, so a problem fails in
    seconds; or, where the ranks are up already and shared by many runs (a sweep's cells),
    on every rank before its pass (``ModelChecks``), so the job's host does no forward per
    cell. The same checks either way, with the same errors. Returns the plan (its
    evaluation's target decided here), the call order, and the checks left to the ranks."""
    evaluation = plan.evaluation
    undecided = evaluation is not None and evaluation.target is None
    checks = ModelChecks(plan.probe, evaluation.probe if evaluation is not None and undecided else None,
                         evaluation.labels if evaluation is not None else None)
    if plan.later.shared is not None:
        return plan, (), checks
    call_order, target = check_model(plan.model, layers, checks, plan.feed)
    if evaluation is not None and undecided:
        plan = replace(plan, evaluation=replace(evaluation, target=target, probe=None))
    return plan, call_order, None


def _kept(plan: RunPlan, scope: str) -> RunPlan:
    """The plan with its described data marked to be kept on the ranks for ``scope`` (under
    names of their own within a shared scope)."""
    keep = plan.later.keep
    if keep is None:
        return plan
    suffix = f":{plan.later.shared.suffix}" if plan.later.shared is not None else ""

    def marked(data: Any, name: str) -> Any:
        if not isinstance(data, DatasetSpec):
            return data
        return replace(data, keep=KeepDecoded(scope, name + suffix, keep.memory_bytes, keep.disk_bytes))

    evaluation = plan.evaluation
    if evaluation is not None:
        evaluation = replace(evaluation, dataset=marked(evaluation.dataset, "evaluation"))
    return replace(plan, data=marked(plan.data, "calibration"), evaluation=evaluation)


def decoding_report(counts: KeptCounts, budget: KeepBudget) -> DecodingReport:
    """The report's ``decoding``, from what the ranks counted."""
    return DecodingReport(
        decoded=counts.decoded, reused=counts.reused, kept_bytes=counts.memory_bytes, spilled_bytes=counts.disk_bytes,
        not_kept=counts.not_kept, memory_budget_bytes=budget.memory_bytes, disk_budget_bytes=budget.disk_bytes,
    )


def _finish(
    plan: RunPlan, layers: list[BatchNormLayer], skipped: list[SkippedLayer],
    old: list[tuple[torch.Tensor, torch.Tensor]], stale: dict[str, torch.Tensor], result: GroupResult,
    placement: Placement, failures: list[str],
) -> RunResult:
    """Write the statistics into the driver's layers and build the report."""
    stats = list(result.stats)
    not_called = apply_statistics(layers, stats, result.steps)  # in layer order
    unreached = set(not_called)
    skipped = skipped + [SkippedLayer(name, "not called by the forward pass") for name in not_called]
    drifts = [
        LayerDrift(layer, *old[i], result.calls[i], stats[i]) for i, layer in enumerate(layers)
        if layer.name not in unreached
    ]
    report = build_report(plan.options, result, drifts, skipped, placement, plan.data, failures)
    if plan.evaluation is not None and result.evaluation is not None:
        report.evaluation = EvaluationSection.of(
            DataSummary.of(plan.evaluation.dataset.summary()), result.evaluation,
            result.evaluation.seconds or 0.0, PYTORCH_RUNTIME,
        )
    calibrated = [layer for layer in layers if layer.name not in unreached]
    return RunResult(report, calibrated, stale, plan.data, plan.evaluation, result.head)


def _time_the_pass(report: Report, plan: RunPlan, result: GroupResult, wall: float, attempts: int) -> None:
    """The statistics pass in the report's timeline (docs/report.md): the ranks' start-up,
    the statistics, and the evaluation before and after (fused: one read of its data,
    both models on each batch, in the same rank call)."""
    where = where_ranks_ran(report)
    evaluating = float(result.evaluation.seconds or 0.0) if result.evaluation else 0.0
    add_to_timeline(report, STARTING_PHASE, max(0.0, wall - result.seconds - evaluating), 0, 0, where)
    add_to_timeline(report, "statistics", result.seconds, result.samples, attempts, where)
    if plan.evaluation is not None and result.evaluation is not None:
        add_to_timeline(report, "evaluation before and after", evaluating, plan.evaluation.dataset.num_samples, 1, where)


def _attempts(
    plan: RunPlan,
    executor: Executor,
    rank_plan: RankPlan,
    policy: FailurePolicy,
    on_progress: ProgressCallback | None,
    cancel: threading.Event | None,
) -> tuple[GroupResult, list[str]]:
    """Run the pass until it succeeds or the policy says to stop; the messages of the
    failures that were retried come back with the result."""
    failures: list[str] = []

    def attempt() -> GroupResult:
        progress = _phase_ordered_progress(plan, on_progress)
        if on_progress is not None:  # the samples to calibrate are known before any worker starts
            # a retry says so, and why, where the user watches (the terminal, the job's phase)
            phase = f"{STARTING_PHASE} again after: {failures[-1]}" if failures else STARTING_PHASE
            on_progress(0, plan.data.num_samples, phase)
        try:
            return executor.execute(rank_plan, plan, progress, cancel)
        except DatasetError:
            _discard_unpacked(plan)
            raise

    return with_retries(attempt, policy, failures), failures


def with_retries(
    call: Callable[[], T], policy: FailurePolicy, failures: list[str], on_retry: Callable[[str], None] | None = None
) -> T:
    """``call()`` under the failure policy, for every phase on the ranks (the statistics, the
    INT8 range pass): a failure the policy retries runs the phase again (``failures`` and
    ``on_retry`` hear why), the last one is raised saying how many retries it had."""
    while True:
        try:
            return call()
        except RunError as exc:
            if policy.make_decision(exc, failures) is FailureDecision.RAISE:
                if failures and not isinstance(exc, CancelledError):
                    raise type(exc)(f"{exc.message} (after {len(failures)} retries)", exc.rank, exc.node) from exc
                raise
            failures.append(exc.message)
            if on_retry is not None:
                on_retry(exc.message)


def _phase_ordered_progress(plan: RunPlan, on_progress: ProgressCallback | None) -> Callable[[str, int], None]:
    """The ranks' (phase, done) reports as (done, total, phase), calibration to its end
    first: a rank may start evaluating while a peer's last steps are on their way."""
    totals = {"calibrating": plan.data.num_samples}
    if plan.evaluation is not None and not plan.later.evaluation_later:
        totals["evaluating"] = plan.evaluation.dataset.num_samples
    seen = dict.fromkeys(totals, 0)
    auto = plan.options.auto_samples

    def progress(phase: str, done: int) -> None:
        seen[phase] = done
        calibrated = seen["calibrating"] >= totals["calibrating"] or (auto and phase == "evaluating")
        if on_progress is None or (phase == "evaluating" and not calibrated):
            return
        on_progress(done, totals.get(phase, totals["calibrating"]), phase)
        if phase == "calibrating" and calibrated and seen.get("evaluating"):
            on_progress(seen["evaluating"], totals["evaluating"], "evaluating")

    return progress


def _discard_unpacked(plan: RunPlan) -> None:
    """Bad content in an unpacked archive (an image that does not decode): keep nothing of it."""
    for spec in plan.datasets():
        if isinstance(spec, DatasetSpec) and spec.kind == "images" and spec.path != spec.source:
            discard_unpack(spec.path)


def check_cancel(cancel: threading.Event | None) -> None:
    """Stop between phases when the run was cancelled."""
    if cancel is not None and cancel.is_set():
        raise CancelledError("the job was cancelled")


def bn_buffer_updates(layers: Sequence[BatchNormLayer]) -> dict[str, torch.Tensor]:
    """The checkpoint entries a recalibration changes, keyed by model key."""
    updates: dict[str, torch.Tensor] = {}
    for layer in layers:
        for role, key in layer.buffer_names().items():
            updates[key] = getattr(layer, role).detach().cpu()
    return updates
