"""Shared fixtures: one real local Ray instance per test session, and small artifacts."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bnrecal.service.cli.main import main
from bnrecal.service.settings import Settings

from tests.postgres import PostgresServer, postgres_server
from tests.timings import pytest_addoption, pytest_configure, select_quick  # noqa: F401 - hooks: the suite's clock and the quick tier
from tests.s3 import FAKE_CREDENTIALS, S3Server, start_s3_server

os.environ.update(FAKE_CREDENTIALS)  # before Ray starts: its workers inherit them (see tests/s3.py)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A real local Ray instance (8 logical CPUs on any machine), started once."""
    import ray

    from bnrecal.service.run.cluster import ensure_ray

    ensure_ray(None, min_cpus=8)
    yield
    ray.shutdown()


_SESSION_POOLS: list[Any] = []
"""The test run's warm pool, once made (at most one a process: each xdist worker has its own)."""

FREE_CPUS_AT_MODULE_START = 4
"""Logical CPUs of the test run's Ray (8) that a module using the warm pool starts with free:
the pool keeps the gangs of earlier modules within the rest (oldest evicted first), so a
module's own actors (the zoo's ranks, a test's gang of 4) are placed at once beside them. A
module that uses the test run's Ray but not the pool starts with none of its gangs held: its
servers' jobs are placed at once, not after the pool hears them wait (``WarmPool.give_way``,
within a second). A module that does not use the test run's Ray leaves the pool as it is, so
the next module that uses it finds its gangs still warm (a job of this process that needs
their CPUs evicts them at once)."""


@pytest.fixture(scope="session")
def warm_pool(ray_cluster: None) -> Iterator[Any]:
    """Warm rank actors shared by the whole test run's jobs, as the server shares them: a job
    pays the ranks' start-up (a process importing torch, ~6 s here) once per shape and run,
    not once per call or module. A failed or cancelled job's ranks are killed, never reused.
    Tests about starting, losing or killing ranks start their own (``WarmPool`` or none)."""
    from bnrecal.workers.ranks.gangs.pool import WarmPool

    pool = WarmPool(idle_s=1800)
    _SESSION_POOLS.append(pool)
    yield pool
    _SESSION_POOLS.remove(pool)
    pool.close()


@pytest.fixture(scope="module", autouse=True)
def _room_beside_the_warm_pool(request: pytest.FixtureRequest) -> None:
    """Each module that uses the warm pool starts with ``FREE_CPUS_AT_MODULE_START`` CPUs that
    no idle warm gang holds; any other module that uses the test run's Ray, or one marked
    ``fresh_ranks`` (about starting, losing or killing ranks, or the cluster's free CPUs), with
    none held; a module that does not use the test run's Ray leaves the pool as it is."""
    import ray

    if not _SESSION_POOLS or not ray.is_initialized():
        return
    items = [item for item in request.session.items if item.getparent(pytest.Module) is request.node]
    uses_pool = any("warm_pool" in getattr(item, "fixturenames", ()) for item in items)
    uses_ray = any("ray_cluster" in getattr(item, "fixturenames", ()) for item in items)
    fresh = request.node.get_closest_marker("fresh_ranks") is not None
    if not (uses_ray or fresh):
        return
    need = FREE_CPUS_AT_MODULE_START if uses_pool and not fresh else math.inf
    for pool in _SESSION_POOLS:
        pool.evict_for({"CPU": need})


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A local S3-compatible server (moto) on loopback, recording the requests it answers."""
    state, httpd = start_s3_server()
    yield state
    httpd.shutdown()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL cluster on loopback (as its own user), started once; each test
    that needs a database makes an empty one with ``create_database()``."""
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty ledger database: an SQLite file, and then a Postgres database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return request.getfixturevalue("postgres").create_database()


def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this test run shared by its xdist workers (each has a base of its own
    below it), for what the whole run makes once."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def demo_cache_name() -> str:
    """The name of the demo inputs kept between test runs, in pytest's cache: the digest of
    what they are a function of (``write_demo_inputs`` is deterministic for a given seed on a
    given machine and thread count), so a change of the demo's code, of a library, of the CPU
    or of its cores trains them again; ``pytest --cache-clear`` does too."""
    import hashlib

    import sklearn
    import torchvision

    from bnrecal.service import demo
    from bnrecal.service.export.cpu import cpu_features

    cpu = cpu_features().describe()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = hashlib.sha256()
    key.update(Path(demo.__file__).read_bytes())
    for part in (torch.__version__, torchvision.__version__, np.__version__, sklearn.__version__, cpu, str(cores)):
        key.update(b"\0" + part.encode())
    return f"demo-inputs-{key.hexdigest()[:16]}"


@pytest.fixture(scope="session")
def demo_inputs(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The quick-start demo's inputs (``make demo``'s stale resnet18 and its data), trained
    once (most of a minute to a few on a busy machine), whichever worker asks first, and kept
    in pytest's cache for the next run on this machine (``demo_cache_name``): the edit-and-test
    loop's ``make check`` does not train them again. A fresh clone (CI) trains them. Each run
    works on its own copy, since the README test writes its outputs beside them."""
    import shutil

    from filelock import FileLock

    from bnrecal.service import demo

    shared = shared_tmp(tmp_path_factory)
    with FileLock(str(shared / "demo.lock")):
        paths = demo.demo_paths(shared / "demo")
        if not all(path.is_file() for path in paths):
            cache = getattr(pytestconfig, "cache", None)
            if cache is None:  # pytest's cache turned off (-p no:cacheprovider): trained for this run only
                demo.write_demo_inputs(shared / "demo")
                return paths
            name = demo_cache_name()
            kept_folder = cache.mkdir(name)
            with FileLock(str(kept_folder.parent / f"{name}.lock")):  # another run of this checkout
                kept = demo.demo_paths(kept_folder)
                if not all(path.is_file() for path in kept):  # the checkpoint is written last, whole
                    demo.write_demo_inputs(kept_folder)
                shutil.copytree(kept_folder, shared / "demo", dirs_exist_ok=True)  # under this run's lock
    return paths


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Settings that allow the test models (``tests.*``) and keep files under tmp_path."""
    return Settings(data_dir=tmp_path / "data", model_modules=["tests"], collective_timeout_s=60)


def save_array(path: Path, array: np.ndarray | torch.Tensor) -> Path:
    """Write calibration samples as .npy."""
    np.save(path, np.asarray(array))
    return path


def save_state(path: Path, model: torch.nn.Module) -> Path:
    """Write a plain state_dict checkpoint."""
    torch.save(model.state_dict(), path)
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``bnrecal ARGS`` in this process as the script would: exit code, stdout, stderr."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


LONGEST_FIRST = (
    "tests/service/run/test_model_zoo.py",
    "tests/service/run/test_model_zoo_timm.py",
    "tests/service/export/test_int8.py",
    "tests/service/run/test_warm_pool.py",
    "tests/workers/ranks/ort/test_rank_pass.py",
    "tests/service/run/test_sampling.py",
    "tests/api/test_ray_loss.py",
    "tests/api/test_scheduling.py",
    "tests/api/test_soak.py",
    "tests/service/run/test_recalibrate_variants.py",
    "tests/service/cli/test_cli_int8.py",
    "tests/service/cli/test_cli_sweep.py",
    "tests/api/test_sweep_jobs.py",
    "tests/service/run/test_recalibrate_transformers.py",
    "tests/api/test_restart.py",
    "tests/test_docs.py",
    "tests/api/test_replicas.py",
    "tests/service/export/test_patterns.py",
)
"""The modules that took longest in the last measured run (worker time), started first: each
worker takes whole modules in this order, so none is left running a long one alone at the end.
A module missing here only runs in collection order; one listed and gone is ignored."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the quick tier with ``--quick``; skip `gpu` tests where no CUDA device is present,
    `vnni` and `no_vnni` tests on the other kind of CPU; start the longest modules first."""
    from bnrecal.service.export.cpu import cpu_features

    select_quick(config, items)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep their order
    vnni = cpu_features(environ={}).vnni
    skips = {"gpu": None if torch.cuda.is_available() else "needs a CUDA device",
             "vnni": None if vnni else "needs a CPU with VNNI",
             "no_vnni": "needs a CPU without VNNI" if vnni else None}
    for item in items:
        for marker, reason in skips.items():
            if reason is not None and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
