"""Fixtures the format tests share: the MDS datasets, written once for the test run (two
modules read them: the index's tests and the reader's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers.data.formats.mds_sets import write_sets


@pytest.fixture(scope="session")
def mds_written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every MDS dataset of :mod:`tests.workers.data.formats.mds_sets`, by name."""
    return write_sets(tmp_path_factory.mktemp("mds"))
