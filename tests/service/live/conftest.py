"""The live API's tests share the test run's warm ranks, as a caller recalibrating many models
in a row would (``workers.ranks.gangs.warm_context.warm_ranks``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bnrecal.workers.ranks.gangs.warm_context import warm_ranks


@pytest.fixture
def warm_live(warm_pool: Any) -> Iterator[Any]:
    """``bnrecal.recalibrate`` calls in this test run on the test run's warm ranks (one worker
    on Ray too); the pool itself, for the tests that also run a recalibration of files."""
    with warm_ranks(warm_pool):
        yield warm_pool
