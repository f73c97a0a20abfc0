"""timm's zoo through the sweep of ``test_model_zoo.py`` (its docstring says what each model
goes through), in a module of its own, so each zoo's time shows in the run's durations."""

from __future__ import annotations

import pytest

from tests.service.run.test_model_zoo import ranks, sweep  # noqa: F401 - ranks is the module's fixture
from tests.zoo import TIMM

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.mark.parametrize("case", [c.param() for c in TIMM])
def test_timm_zoo(ranks, case, tmp_path):  # noqa: F811 - ranks is the imported fixture
    pytest.importorskip("timm", reason="the timm extra is part of the test extras: pip install -e '.[test]'")
    sweep(ranks, case, tmp_path)
