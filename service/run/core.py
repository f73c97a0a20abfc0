"""The one run core: ``running(plan, executor)`` (and ``run``, the statistics alone), for
the command line, the job server and the Python API alike.

A :class:`RunPlan` says what a surface has prepared: the driver's model (its BN buffers
receive the statistics), how the ranks build it (a model source and the weights
that travel), the data, the evaluation, and the run options. An executor says where the
ranks run (``service.run.executors``): ``InProcess`` (one rank in the calling process, no
Ray) or ``RayRanks`` (a rank group on Ray, warm from a pool when there is one). A
:class:`RunControl` holds how the run fails and stops: its :class:`FailurePolicy` (whether
a failed pass runs again), the failures retried, the cancel token. The core finds the BN
layers, checks the model on the first batch (its call order, what the evaluation can
measure: here, or on a sweep's ranks), runs the pass (statistics, and the evaluation after
them, fused on the ranks), writes the statistics into the driver's model
and builds the typed report (docs/report.md). What each surface does before (load a
checkpoint, ship a live model) and after (save, export, write back into a caller's
model) stays with the surface, which runs its later phases inside ``running``'s block,
while the ranks are up: the core never calls back into a surface.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from bnrecal.workers.data import DatasetSpec, discard_unpack
from bnrecal.workers.data.reading.kept import KeepDecoded, KeptCounts
from bnrecal.workers.data.formats.loader import LoaderSpec
from bnrecal.workers.engine.batchnorm import BatchNormLayer, SkippedLayer, require_batchnorm_layers
from bnrecal.workers.engine.statistics_pass import StopRule, apply_statistics
from bnrecal.errors import CallOrderError, CancelledError, DatasetError, RunError
from bnrecal.workers.models.sources import ModelSource
from bnrecal.workers.ranks.process.work import IN_PROCESS, check_model
from bnrecal.workers.ranks.plan import EvalPlan, GroupResult, ModelChecks, RankPlan

from bnrecal.service.run.options import STARTING_PHASE, RunOptions
from bnrecal.service.run.report.document import (
    PYTORCH_RUNTIME, DataSummary, DecodingReport, EvaluationSection, LayerDrift, Placement, Report, add_to_timeline,
    build_report, where_ranks_ran,
)


ProgressCallback = Callable[[int, int | None, str], None]
"""Called with (samples done, samples total, phase): ``starting workers`` before each
attempt, then ``calibrating``, then ``evaluating`` when the plan evaluates; a later phase
that counts no samples (``exporting``, ``quantizing to INT8``, ...) with total None."""

log = logging.getLogger("bnrecal.run")

Feed = Callable[[nn.Module, Any], Any]
T = TypeVar("T")


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
    ranges). ``ahead`` starts host work of a later phase that does not need the statistics
    (the export's trace: ``service.run.recalibrate.trace_ahead``), called once the model is
    checked here, as the ranks start."""

    keep: KeepBudget | None = None
    head: int = 0
    evaluation_later: bool = False
    shared: SharedScope | None = None
    ahead: Callable[[], None] | None = None


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
    there between calls lives under it (``workers.ranks.process.scoped``)."""

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


@dataclass
class RunControl:
    """How a run's phases on the ranks fail and stop, one object they share: the failure
    policy, the failures it retried (in order: the report's ``retried_failures``), and the
    cancel token a surface sets to stop the run between steps. The statistics have theirs;
    the phases after them (the exports, the INT8 passes) share another (``later``), so each
    has the policy's retries."""

    policy: FailurePolicy = field(default_factory=FailurePolicy)
    cancel: threading.Event | None = None
    failures: list[str] = field(default_factory=list)

    def later(self) -> RunControl:
        """The control of the phases after the statistics: the same policy and token, no failures yet."""
        return RunControl(self.policy, self.cancel)

    def check_cancel(self) -> None:
        """Stop between steps when the run was cancelled (``CancelledError``)."""
        check_cancel(self.cancel)

    def retried(self, call: Callable[[], T], on_retry: Callable[[str], None] | None = None) -> T:
        """``call()`` under the policy, for every phase on the ranks (the statistics, the
        INT8 range pass, a later phase's work): a failure the policy retries runs the phase
        again (``failures`` and ``on_retry`` hear why), the last one is raised saying how
        many retries it had."""
        while True:
            try:
                return call()
            except RunError as exc:
                if self.policy.make_decision(exc, self.failures) is FailureDecision.RAISE:
                    if self.failures and not isinstance(exc, CancelledError):
                        raise type(exc)(f"{exc.message} (after {len(self.failures)} retries)", exc.rank, exc.node) from exc
                    raise
                self.failures.append(exc.message)
                if on_retry is not None:
                    on_retry(exc.message)


@dataclass(frozen=True)
class RankSet:
    """A run's Ray ranks as the phases after its statistics use them for their own passes and
    work (``service.run.outputs``): how many, on which device, placed how (``group``, the
    ranks' ``GroupOptions``), each rank's samples in the object store where the data travels
    that way (``shards``, ``eval_shards``; None where each rank reads it), and the job's gang
    they run in (``gang``, a ``JobGang`` or a ``WarmPool``; None: a fresh gang a call)."""

    workers: int
    device: str
    group: Any
    shards: list[Any] | None = None
    eval_shards: list[Any] | None = None
    gang: Any = None

    def map(self, work: Callable[..., T], calls: Sequence[tuple[Any, ...]], *, control: RunControl,
            on_phase: Callable[[str], None] | None) -> list[T]:
        """``work(*args)`` for each of ``calls`` on the ranks, spread over them
        (``workers.ranks.offload``), results in order, under the run's ``control``: a lost rank
        runs the calls again on a fresh gang (its ``failures`` and ``on_phase`` hear why)."""
        from bnrecal.workers.ranks.offload import run_on_ranks

        def attempt() -> list[T]:
            control.check_cancel()
            return run_on_ranks(work, calls, self.workers, self.device, self.group, pool=self.gang,
                                cancel=control.cancel)

        retried = (lambda why: on_phase(f"running the later phase's work again after: {why}")) if on_phase else None
        return control.retried(attempt, retried)


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

    def ranks(self) -> RankSet | None:
        """The run's ranks, for the phases after the statistics (the exports, the INT8
        passes and work: ``service.run.outputs``); None where those run in this process, a
        world of one, as its statistics did."""

    def release_decoded(self, scope: str) -> KeptCounts:
        """The run is over: the ranks drop the samples they kept for ``scope``; what its
        passes decoded and reused (idempotent: zeros the second time)."""

    def close(self) -> None:
        """Stop what ``start`` started for this run only."""


@contextmanager
def running(
    plan: RunPlan,
    executor: Executor,
    control: RunControl | None = None,
    on_progress: ProgressCallback | None = None,
) -> Iterator[RunResult]:
    """The run as a block: on entry, every BN layer's running statistics of ``plan.model``
    recomputed on the executor's ranks (docs/calibration.md), and the evaluation when the
    plan says so; the block gets the result, with the report, while the ranks are still up,
    for the phases its surface runs after the statistics (the export and INT8 files:
    ``service.run.outputs.later_phases``, on the same executor), unless the run was cancelled as its pass
    ended (``CancelledError``); on exit the ranks let go of what they kept, and the executor
    is closed."""
    control = control or RunControl()
    options = plan.options
    shared = plan.later.shared
    scope = shared.scope if shared is not None else uuid.uuid4().hex
    plan = _kept(plan, scope)
    try:
        try:
            layers, skipped = require_batchnorm_layers(plan.model, plan.label)
            plan, call_order, checks = _check_model(plan, layers)
            if plan.later.ahead is not None:  # the model's own checks are done: its forwards on this host
                plan.later.ahead()
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
            result = _attempts(plan, executor, rank_plan, control, on_progress)
            wall = time.monotonic() - started
            if plan.evaluation is not None and plan.evaluation.target is None:  # the ranks decided it
                if result.eval_target is None:
                    raise RunError("the ranks did not say what the evaluation measures")
                plan = replace(plan, evaluation=replace(plan.evaluation, target=result.eval_target, probe=None))
            placement = executor.placement(plan)
        finally:
            if plan.release is not None:
                plan.release()
        finished = _finish(plan, layers, skipped, old, stale, result, placement, control.failures)
        finished.scope = scope
        _time_the_pass(finished.report, plan, result, wall, len(control.failures) + 1)
        control.check_cancel()  # cancelled as the pass ended: no later phase starts
        yield finished
        if plan.later.keep is not None and shared is None:  # a shared scope's owner reports its decoding
            finished.report.decoding = decoding_report(executor.release_decoded(scope), plan.later.keep)
    finally:
        try:
            executor.release_decoded(scope)
        finally:
            executor.close()


def run(
    plan: RunPlan, executor: Executor, control: RunControl | None = None, on_progress: ProgressCallback | None = None,
) -> RunResult:
    """The statistics alone (``running`` with nothing after them): the result, with the report."""
    with running(plan, executor, control, on_progress) as finished:
        return finished


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
    control: RunControl,
    on_progress: ProgressCallback | None,
) -> GroupResult:
    """Run the pass until it succeeds or the policy says to stop; the messages of the
    failures that were retried are in ``control.failures``."""

    def attempt() -> GroupResult:
        progress = _phase_ordered_progress(plan, on_progress)
        if on_progress is not None:  # the samples to calibrate are known before any worker starts
            # a retry says so, and why, where the user watches (the terminal, the job's phase)
            failures = control.failures
            phase = f"{STARTING_PHASE} again after: {failures[-1]}" if failures else STARTING_PHASE
            on_progress(0, plan.data.num_samples, phase)
        try:
            return executor.execute(rank_plan, plan, progress, control.cancel)
        except DatasetError:
            _discard_unpacked(plan)
            raise

    return control.retried(attempt)


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
