"""The one run core (``service.run.core``): ``run(plan, executor)`` gives the documented
statistics through either executor, and its ``FailurePolicy`` decides retries: a lost
pass runs again from the start (the report says so), bad input, a call order that
differs and a cancellation never do, and the error after the last retry says how many."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from bnrecal.errors import CallOrderError, CancelledError, DatasetError, RunError
from bnrecal.workers.models.sources import LiveModuleSource

from bnrecal.service.run.core import FailureDecision, FailurePolicy, RunControl, RunPlan, run, running
from bnrecal.service.run.executors import InProcess
from bnrecal.service.run.outputs.onnx_passes import InProcessPasses, passes_on
from bnrecal.service.run.options import RunOptions
from bnrecal.service.run.report.document import Report
from bnrecal.service.live.data import describe_python_data
from bnrecal.service.settings import Settings

from tests.nets import mixed_net, perturbed
from tests.reference import assert_matches_reference, reference_statistics


def test_the_policy_retries_what_a_new_attempt_can_cure():
    policy = FailurePolicy(max_retries=2)
    lost = RunError("rank 1 died", rank=1)
    assert policy.make_decision(lost, []) is FailureDecision.RETRY
    assert policy.make_decision(lost, ["a"]) is FailureDecision.RETRY
    assert policy.make_decision(lost, ["a", "b"]) is FailureDecision.RAISE
    for never in (CancelledError("cancelled"), CallOrderError("order differs"), DatasetError("bad image"),
                  ValueError("a bug")):
        assert policy.make_decision(never, []) is FailureDecision.RAISE, type(never).__name__
    assert FailurePolicy().make_decision(lost, []) is FailureDecision.RAISE  # no retries unless asked


class LosesPasses(InProcess):
    """The real in-process executor, whose first ``losses`` passes end as a lost rank would:
    after the pass ran (its statistics thrown away), a ``RunError``."""

    def __init__(self, losses: int) -> None:
        self.losses = losses
        self.passes = 0

    def execute(self, plan, run_plan, on_progress, cancel):
        result = super().execute(plan, run_plan, on_progress, cancel)
        self.passes += 1
        if self.passes <= self.losses:
            raise RunError(f"rank 0 was lost in pass {self.passes}", rank=0, node="node-a")
        return result


def plan_for(model: torch.nn.Module, samples: torch.Tensor, batch_size: int = 8) -> RunPlan:
    spec = describe_python_data(samples, batch_size=batch_size, max_samples=None, select_input=True, settings=Settings())
    options = RunOptions.checked(workers=1, batch_size=batch_size)
    return RunPlan(
        model=model, source=LiveModuleSource("mixed"), weights=model, label="model Mixed", data=spec,
        probe=samples[:2], options=options, memory_format="contiguous",
    )


@pytest.fixture()
def stale() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(3)
    return perturbed(mixed_net()), torch.randn(29, 3, 6, 5) * 2 + 0.5


def test_run_gives_the_reference_statistics_and_a_typed_report(stale):
    model, samples = stale
    reference = reference_statistics(model, samples, batch_size=8)
    phases: list[str] = []
    result = run(plan_for(model, samples), InProcess(), on_progress=lambda done, total, phase: phases.append(phase))
    assert_matches_reference(model, reference)
    report = result.report
    assert isinstance(report, Report) and report.samples == 29 and report.steps == 4 and report.attempts == 1
    assert report["layers"][0]["name"] == report.layers[0].name and report.to_dict()["backend"] == "in-process"
    assert phases[0] == "starting workers" and phases[-1] == "calibrating"
    assert set(result.updates) >= {f"{layer.name}.running_var" for layer in report.layers}


def test_a_lost_pass_runs_again_and_gives_the_same_statistics(stale):
    model, samples = stale
    clean = run(plan_for(copy.deepcopy(model), samples), InProcess())
    executor = LosesPasses(losses=1)
    phases: list[str] = []
    result = run(plan_for(model, samples), executor, RunControl(FailurePolicy(max_retries=1)),
                 on_progress=lambda done, total, phase: phases.append(phase))
    assert executor.passes == 2
    assert "starting workers again after: rank 0 was lost in pass 1" in phases  # the user sees the retry
    assert result.report.attempts == 2 and result.report.retried_failures == ["rank 0 was lost in pass 1"]
    for key, value in clean.updates.items():
        assert torch.equal(result.updates[key], value), key  # a retry gives identical statistics


def test_the_error_after_the_last_retry_says_how_many_and_nothing_is_written(stale):
    model, samples = stale
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RunError, match=r"rank 0 was lost in pass 3 \(after 2 retries\)") as caught:
        run(plan_for(model, samples), LosesPasses(losses=5), RunControl(FailurePolicy(max_retries=2)))
    assert caught.value.rank == 0 and caught.value.node == "node-a"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_cancelled_pass_is_not_retried(stale):
    model, samples = stale
    cancel = threading.Event()
    cancel.set()
    executor = LosesPasses(losses=0)
    with pytest.raises(CancelledError):
        run(plan_for(model, samples), executor, RunControl(FailurePolicy(max_retries=3), cancel))
    assert executor.passes == 0


def test_release_runs_even_when_the_run_fails_early():
    released = []
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))  # no BN: refused before any pass
    plan = plan_for(model, torch.randn(4, 3))
    plan = RunPlan(**{**plan.__dict__, "release": lambda: released.append(True)})
    with pytest.raises(Exception, match="no BatchNorm layer"):
        run(plan, InProcess())
    assert released == [True]


class Watched(InProcess):
    """The real in-process executor, noting when it is closed."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_later_phases_run_on_the_open_executor_after_the_statistics(stale):
    """The export and INT8 phases of a run, in ``running``'s block, see the statistics
    written and the executor's world still up (its onnxruntime passes are theirs), and a
    failing phase still closes it."""
    model, samples = stale
    reference = reference_statistics(model, samples, batch_size=8)
    executor = Watched()
    plan = plan_for(model, samples)
    with running(plan, executor) as result:
        assert not executor.closed
        assert_matches_reference(model, reference)  # the statistics are in the driver's model already
        passes = passes_on(executor.ranks(), plan.data, 8, 16, None, control=RunControl(), on_phase=None, record=None)
        assert result.report.samples == 29 and isinstance(passes, InProcessPasses) and passes.samples == 16
    assert executor.closed

    executor = Watched()
    with pytest.raises(RunError, match="INT8 ranks were lost"):
        with running(plan_for(model, samples), executor):
            raise RunError("the INT8 ranks were lost")
    assert executor.closed


def test_the_later_phases_control_has_the_runs_policy_and_token_and_failures_of_its_own():
    cancel = threading.Event()
    control = RunControl(FailurePolicy(max_retries=1), cancel, ["rank 0 died"])
    later = control.later()
    assert (later.policy, later.cancel, later.failures) == (control.policy, cancel, [])
    lost = iter([RunError("rank 1 died", rank=1)])

    def flaky() -> str:
        error = next(lost, None)
        if error is not None:
            raise error
        return "done"

    assert later.retried(flaky) == "done" and later.failures == ["rank 1 died"]
    assert control.failures == ["rank 0 died"]  # the statistics' failures stay theirs
    cancel.set()
    with pytest.raises(CancelledError):
        later.check_cancel()


class CancelledAfterThePass(InProcess):
    """The real in-process executor, with a user's cancel arriving as its pass ends."""

    def __init__(self, cancel: threading.Event) -> None:
        self.cancel = cancel

    def execute(self, plan, run_plan, on_progress, cancel):
        try:
            return super().execute(plan, run_plan, on_progress, cancel)
        finally:
            self.cancel.set()


def test_a_run_cancelled_after_its_statistics_runs_no_later_phase(stale):
    model, samples = stale
    cancel, ran = threading.Event(), []
    with pytest.raises(CancelledError):
        with running(plan_for(model, samples), CancelledAfterThePass(cancel), RunControl(cancel=cancel)):
            ran.append(True)
    assert ran == []
