"""Work handed to real Ray ranks (``workers.ranks.offload``): spread over the gang in the
ranks' own processes, results in the order of the calls; a call's own error as it is, any
other naming its rank; a rank that dies mid-call named; a cancel stops the wait at once, and
a stuck rank fails within the timeout."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from bnrecal.errors import CancelledError, RunError, SpecError
from bnrecal.workers.ranks.offload import run_on_ranks
from bnrecal.workers.ranks.plan import GroupOptions

OPTIONS = GroupOptions(cpus_per_worker=1)


def where(index: int, blob: bytes) -> tuple[int, int, int]:
    """The call's index, the process it ran in, and the size of what it was handed."""
    return index, os.getpid(), len(blob)


def fails(kind: str) -> None:
    if kind == "ours":
        raise SpecError("a field of ours is wrong", field="int8.method")
    if kind == "theirs":
        raise ValueError("something in a library went wrong")
    if kind == "dies":
        os.kill(os.getpid(), signal.SIGKILL)


def sleeps(seconds: float) -> None:
    time.sleep(seconds)


def test_calls_are_spread_over_the_ranks_processes_in_order(warm_pool):
    blob = os.urandom(1 << 20)  # handed to every call: it travels to the object store once
    results = run_on_ranks(where, [(i, blob) for i in range(5)], 2, "cpu", OPTIONS, pool=warm_pool)
    assert [index for index, _, _ in results] == list(range(5))
    assert all(size == len(blob) for _, _, size in results)
    pids = [pid for _, pid, _ in results]
    assert os.getpid() not in pids  # none of it on the driver
    assert len(set(pids)) == 2 and pids[0::2] == [pids[0]] * 3 and pids[1::2] == [pids[1]] * 2
    assert run_on_ranks(where, [], 2, "cpu", OPTIONS, pool=warm_pool) == []


def test_a_calls_error_is_its_own_or_names_its_rank(warm_pool):
    with pytest.raises(SpecError, match="a field of ours is wrong") as ours:
        run_on_ranks(fails, [("none",), ("ours",)], 2, "cpu", OPTIONS, pool=warm_pool)
    assert ours.value.field == "int8.method"
    with pytest.raises(RunError, match=r"rank 1 .*failed in a later phase's work: .*ValueError") as theirs:
        run_on_ranks(fails, [("none",), ("theirs",)], 2, "cpu", OPTIONS, pool=warm_pool)
    assert theirs.value.rank == 1


def test_a_rank_that_dies_mid_call_is_named(warm_pool):
    with pytest.raises(RunError, match=r"rank 1 died in a later phase's work") as died:
        run_on_ranks(fails, [("none",), ("dies",)], 2, "cpu", OPTIONS, pool=warm_pool)
    assert died.value.rank == 1
    # the gang with the dead rank was killed, not lent again: the next calls run on live ranks
    assert len(run_on_ranks(where, [(0, b""), (1, b"")], 2, "cpu", OPTIONS, pool=warm_pool)) == 2


def test_a_cancel_stops_the_wait_at_once(warm_pool):
    cancel = threading.Event()
    threading.Timer(1.0, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(CancelledError):
        run_on_ranks(sleeps, [(60.0,), (60.0,)], 2, "cpu", OPTIONS, pool=warm_pool, cancel=cancel)
    assert time.monotonic() - started < 20


def test_a_stuck_rank_fails_within_the_timeout(warm_pool):
    started = time.monotonic()
    quick = GroupOptions(cpus_per_worker=1, collective_timeout_s=2.0)
    with pytest.raises(RunError, match=r"rank 1 did not finish a later phase's work within 2 s a call") as stuck:
        run_on_ranks(sleeps, [(0.0,), (60.0,)], 2, "cpu", quick, pool=warm_pool)
    assert stuck.value.rank == 1 and time.monotonic() - started < 20
