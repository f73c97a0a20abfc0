"""The one background-chore loop of the server: it ticks, outlives a failing tick, ends when
a tick says so or when stopped, and is off at an interval of 0."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from bnrecal.service.jobserver.periodic import Periodic

log = logging.getLogger("bnrecal.test-periodic")


def test_a_failing_tick_is_logged_and_the_next_one_comes(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []
    third = threading.Event()

    def tick() -> None:
        calls.append(len(calls))
        if len(calls) == 3:
            third.set()
        if len(calls) == 1:
            raise OSError("the database is locked")

    chore = Periodic("test-chore", 0.01, tick, "the chore failed", log)
    with caplog.at_level(logging.ERROR, logger=log.name):
        chore.start()
        assert third.wait(10)
        chore.stop()
    assert not chore._thread.is_alive()
    assert [r.getMessage() for r in caplog.records] == ["the chore failed; trying again in 0.01 s"]
    assert "the database is locked" in caplog.text
    ended = len(calls)
    time.sleep(0.05)  # five intervals: nothing ticks after stop
    assert len(calls) == ended


def test_a_tick_that_returns_false_ends_the_chore() -> None:
    calls: list[int] = []
    chore = Periodic("test-chore", 0.01, lambda: calls.append(1) or False, "the chore failed", log)
    chore.start()
    chore._thread.join(10)
    assert not chore._thread.is_alive() and calls == [1]


def test_a_long_tick_waits_and_learns_it_is_stopping() -> None:
    inside, answers = threading.Event(), []

    def tick() -> None:
        inside.set()
        answers.append(chore.wait(30))  # returns at once when stopped, not after 30 s
        answers.append(chore.stopping)

    chore = Periodic("test-chore", 0.01, tick, "the chore failed", log)
    chore.start()
    assert inside.wait(10)
    chore.stop(timeout=10)
    assert answers == [True, True] and not chore._thread.is_alive()


def test_an_interval_of_zero_is_off() -> None:
    chore = Periodic("test-chore", 0, lambda: None, "the chore failed", log)
    chore.start()
    chore.stop()
    assert chore._thread is None
