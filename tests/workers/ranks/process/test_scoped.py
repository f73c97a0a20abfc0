"""What a process keeps for a job's scope between calls (``workers.ranks.process.scoped``): made once
per scope and name, dropped with the scope, and in a rank actor (one scope at a time) dropped
when the next job's scope arrives, so a warm rank hands nothing of one job to another."""

from __future__ import annotations

import pytest

from bnrecal.workers.data.reading.kept import STORE
from bnrecal.workers.ranks.process.scoped import object_scopes, release_scope, scope_object


@pytest.fixture
def one_scope(monkeypatch):
    """This process as a rank actor sees it: one scope at a time (``keep_one_scope``)."""
    monkeypatch.setattr(STORE, "one_scope", True)


class Graphs:
    """A kind of object a scope keeps, counted as it is made."""

    made = 0

    def __init__(self) -> None:
        Graphs.made += 1


def test_an_object_is_made_once_per_scope_and_dropped_with_it():
    Graphs.made = 0
    first = scope_object("job-a", Graphs)
    assert scope_object("job-a", Graphs) is first and Graphs.made == 1
    assert scope_object("job-b", Graphs) is not first  # another job's scope: its own
    assert set(object_scopes()) >= {"job-a", "job-b"}
    release_scope("job-a")
    release_scope("job-b")
    assert "job-a" not in object_scopes() and "job-b" not in object_scopes()
    assert scope_object("job-a", Graphs) is not first and Graphs.made == 3
    release_scope("job-a")


@pytest.mark.usefixtures("one_scope")
def test_a_rank_keeps_one_scope_and_drops_the_older_one_when_a_new_one_arrives():
    first = scope_object("job-a", Graphs)
    scope_object("job-b", Graphs)
    assert object_scopes() == ["job-b"]
    assert scope_object("job-a", Graphs) is not first  # job-a's object was dropped, not handed back
    release_scope("job-a")
    assert object_scopes() == []
