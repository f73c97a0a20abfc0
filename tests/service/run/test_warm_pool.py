"""The warm pool on a real local Ray: reuse, isolation between jobs, idle release,
eviction for a job that needs the CPUs (of this process or another), and no reuse after a
cancelled or failed job."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

from bnrecal.errors import CancelledError, RunError
from bnrecal.workers.ranks.process.actor import RankState
from bnrecal.workers.ranks.process.allocator import RANK_ENV_VARS
from bnrecal.workers.ranks.plan import GroupOptions
from bnrecal.workers.ranks.gangs.pool import GangKey, WarmPool, held_gang

from bnrecal.service.jobserver.records.spec import JobSpec
from bnrecal.service.run.recalibrate import RecalibrationRequest, recalibrate

from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net, mixed_net, perturbed

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.fresh_ranks]  # the cluster's free CPUs are checked here


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict]]:
    """Two different mixed_nets (6 and 4 channels), each with its own checkpoint and data."""
    folder = tmp_path_factory.mktemp("pool")
    made = {}
    for name, channels, seed in (("six", 6, 0), ("four", 4, 1)):
        torch.manual_seed(seed)
        model = perturbed(mixed_net(channels), seed=seed)
        samples = torch.randn(17, 3, 6, 5) * (1.0 + seed) + 0.3 * seed
        made[name] = (
            save_state(folder / f"{name}.pt", model),
            save_array(folder / f"{name}.npy", samples),
            {"channels": channels},
        )
    return made


def request_for(entry: tuple[Path, Path, dict], **options) -> RecalibrationRequest:
    checkpoint, data, kwargs = entry
    return RecalibrationRequest(
        arch="tests.nets:mixed_net", checkpoint=checkpoint, data=data, model_kwargs=kwargs,
        workers=2, batch_size=4, **options,
    )


def idle_states(pool: WarmPool) -> list[list[RankState]]:
    """What each rank of each idle gang reports about itself."""
    return [ray.get([actor.state.remote() for actor in gang.actors]) for gang in pool.idle()]


def process_gone(pid: int, timeout: float = 15.0) -> bool:
    """Whether the process exits (or is a zombie) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def free_cpus_reach(expected: float, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free >= expected - 1e-9 or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def test_a_second_job_reuses_the_ranks_and_matches_fresh_actors(two_models, settings):
    # Contiguous, so this job also covers the layout "auto" does not choose for images.
    settings = settings.model_copy(update={"cpus_per_worker": 1.0, "memory_format": "contiguous"})
    pool = WarmPool(idle_s=120)
    try:
        recalibrate(request_for(two_models["six"]), settings, pool=pool)
        [first] = idle_states(pool)
        assert [s.jobs for s in first] == [1, 1] and [s.groups for s in first] == [(), ()]
        assert all(s.allocator == RANK_ENV_VARS for s in first)  # ranks start with the malloc settings
        warm = recalibrate(request_for(two_models["four"]), settings, pool=pool)  # another model, same shape
        [second] = idle_states(pool)
        assert [s.pid for s in second] == [s.pid for s in first]  # the same processes
        assert [s.jobs for s in second] == [2, 2]
        assert all(s.threads == 1 and s.groups == () for s in second)
        assert [s.initial_seed for s in second] == [s.initial_seed for s in first]  # a fresh process's seed
        [gang] = pool.idle()
        ray.kill(gang.actors[1], no_restart=True)  # a warm rank dies while idle (say, the OOM killer)
        assert process_gone(second[1].pid)
        recalibrate(request_for(two_models["six"]), settings, pool=pool)  # not failed by it: a fresh gang
        [third] = idle_states(pool)
        assert [s.jobs for s in third] == [1, 1] and {s.pid for s in third}.isdisjoint(
            s.pid for s in second
        )
        assert process_gone(second[0].pid)  # the dead rank's peer was killed with its gang
    finally:
        pool.close()
    fresh = recalibrate(request_for(two_models["four"]), settings)  # its own actors, killed after
    assert warm.updates.keys() == fresh.updates.keys()
    for key, value in fresh.updates.items():
        assert torch.equal(warm.updates[key], value), key  # nothing of the first job leaked into the second
    assert all(process_gone(s.pid) for s in third)  # close killed the idle gang


def test_idle_ranks_give_their_cpus_back(two_models, settings):
    settings = settings.model_copy(update={"cpus_per_worker": 1.0})
    free_before = free_cpus_reach(ray.cluster_resources()["CPU"], timeout=30)
    pool = WarmPool(idle_s=3)
    try:
        recalibrate(request_for(two_models["six"]), settings, pool=pool)
        [ranks] = idle_states(pool)
        assert pool.idle_resources()["CPU"] == 2.0
        assert ray.available_resources().get("CPU", 0.0) <= free_before - 2.0 + 1e-9  # held while warm
        assert free_cpus_reach(free_before, timeout=20) >= free_before  # released after idle_s
        assert pool.idle() == []
        assert all(process_gone(s.pid) for s in ranks)
    finally:
        pool.close()


def test_an_idle_gang_gives_way_to_a_job_that_needs_its_cpus(two_models, settings):
    # All that is free (another test's idle warm gang may still hold some of the cluster).
    free = free_cpus_reach(ray.cluster_resources()["CPU"], timeout=30)
    assert free >= 4, f"only {free} CPUs free"
    big = settings.model_copy(update={"cpus_per_worker": float(int(free // 2))})
    pool = WarmPool(idle_s=120)
    try:
        recalibrate(request_for(two_models["six"]), big, pool=pool)
        [held] = idle_states(pool)
        other = settings.model_copy(update={"cpus_per_worker": 1.0, "placement_timeout_s": 60})
        started = time.monotonic()
        result = recalibrate(request_for(two_models["six"]), other, pool=pool)  # another shape: needs room
        assert time.monotonic() - started < 50  # evicted, not waited out
        assert result.report["samples"] == 17
        assert all(process_gone(s.pid) for s in held)
        assert [gang.key.cpus_per_worker for gang in pool.idle()] == [1.0]
    finally:
        pool.close()


@ray.remote(num_cpus=0)
class OtherProcess:
    """Another process of the cluster with a warm pool of its own, as a second server's job
    host (or a caller's process) has."""

    def __init__(self) -> None:
        self.pool = WarmPool(idle_s=600)

    def hold(self, cpus: float) -> None:
        """Leave an idle gang of one rank holding ``cpus`` in the pool, for its 600 s."""
        key = GangKey(1, cpus, 0.0, "PACK", "cpu")
        with held_gang(key, GroupOptions(cpus_per_worker=cpus, placement_timeout_s=30), self.pool):
            pass

    def idle(self) -> int:
        return len(self.pool.idle())

    def close(self) -> None:
        self.pool.close()


def test_an_idle_gang_of_another_process_gives_way_within_seconds(two_models, settings):
    # Every free CPU held by another process's idle gang (a second server's job host, say):
    # this process's job is placed once that pool hears it wait, not after the pool's 600 s.
    free = free_cpus_reach(ray.cluster_resources()["CPU"], timeout=30)
    other = OtherProcess.remote()
    try:
        ray.get(other.hold.remote(free))
        assert ray.get(other.idle.remote()) == 1 and ray.available_resources().get("CPU", 0.0) < 1.0
        placing = settings.model_copy(update={"cpus_per_worker": 1.0, "placement_timeout_s": 60})
        started = time.monotonic()
        result = recalibrate(request_for(two_models["six"]), placing)  # no pool of this process holds anything
        assert time.monotonic() - started < 30
        assert result.report["samples"] == 17
        assert ray.get(other.idle.remote()) == 0
    finally:
        ray.get(other.close.remote())
        ray.kill(other)


def marked(tmp_path: Path) -> tuple[Path, Path]:
    samples = torch.randn(40, 4)
    samples[4 * 3 + 3, 0] = MARKER  # rank 1 misbehaves at its second step
    return save_state(tmp_path / "m.pt", marker_net()), save_array(tmp_path / "m.npy", samples)


def set_once_hanging(signals: Path, cancel: threading.Event, timeout: float = 120.0) -> None:
    """Set ``cancel`` once a rank of marker_net hangs on its marked sample (as soon as it is
    mid-run, rather than after a fixed wait), or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not list(signals.glob("hanging-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    cancel.set()


@pytest.mark.parametrize("outcome", ["failed", "cancelled"])
def test_ranks_of_a_failed_or_cancelled_job_are_killed_not_kept(settings, tmp_path, outcome):
    settings = settings.model_copy(update={"cpus_per_worker": 1.0, "collective_timeout_s": 60})
    checkpoint, data = marked(tmp_path)
    clean = save_array(tmp_path / "clean.npy", torch.randn(16, 4))
    pool = WarmPool(idle_s=120)
    base = {"arch": "tests.nets:marker_net", "checkpoint": checkpoint, "workers": 2, "batch_size": 4, "order": "given"}
    try:
        recalibrate(RecalibrationRequest(**base, data=clean), settings, pool=pool)
        [warm] = idle_states(pool)
        action = "exit" if outcome == "failed" else "hang"
        signals = tmp_path / "signals"
        signals.mkdir()
        request = RecalibrationRequest(**base, data=data, model_kwargs={"action": action, "signal_dir": str(signals)})
        cancel = threading.Event()
        if outcome == "cancelled":  # once rank 1 hangs mid-run on the warm gang (it leaves hanging-<pid>)
            threading.Thread(target=set_once_hanging, args=(signals, cancel), daemon=True).start()
        with pytest.raises(CancelledError if outcome == "cancelled" else RunError):
            recalibrate(request, settings, cancel=cancel, pool=pool)  # on the warm gang
        assert pool.idle() == []  # not handed back
        assert all(process_gone(s.pid) for s in warm)  # killed, both ranks
        again = recalibrate(RecalibrationRequest(**base, data=clean), settings, pool=pool)
        assert again.report["samples"] == 16  # a fresh gang serves the next job
        assert [s.jobs for s in idle_states(pool)[0]] == [1, 1]
    finally:
        pool.close()


def test_a_disabled_pool_keeps_nothing(two_models, settings):
    settings = settings.model_copy(update={"cpus_per_worker": 1.0})
    pool = WarmPool(idle_s=0)
    try:
        recalibrate(request_for(two_models["six"]), settings, pool=pool)
        assert pool.idle() == [] and not pool.enabled
    finally:
        pool.close()


def test_closing_the_services_kills_the_warm_ranks(two_models, settings):
    from bnrecal.service.jobserver.server import open_services

    services = open_services(settings.model_copy(update={"cpus_per_worker": 1.0, "warm_pool_idle_s": 300}))
    host = services.pool  # the job host: the server's jobs run there, and their warm ranks live there
    try:
        assert host is not None and services.runner.host is host
        spec = JobSpec(arch="tests.nets:mixed_net", checkpoint="sha256:" + "0" * 64, data="sha256:" + "0" * 64)
        made = host.run("closing", request_for(two_models["six"]), services.settings, spec.with_outputs(),
                        services.settings.data_dir / "work" / "closing", threading.Event(), lambda events: None)
        assert made.report["samples"] == 17 and made.files["checkpoint"][0].is_file()
        [gang] = host.idle()
        assert gang.jobs == 1 and len(gang.pids) == 2
    finally:
        services.close()
    assert host.idle() == []
    assert all(process_gone(pid) for pid in gang.pids)


def test_a_job_holds_its_ranks_across_its_passes_and_leaves_them_holding_nothing(settings, tmp_path):
    """A job with an INT8 file runs its statistics, range and scoring passes on one warm gang
    (the ranks' kept photos serve the later passes), and gives it back holding no kept sample
    and no spill file; the next job takes the same processes."""
    from bnrecal.service.export.int8.options import Int8Options
    from bnrecal.service.run.outputs.later_phases import RunOutputs
    from tests.nets import classifier_net
    from tests.shards import photos, write_folder

    write_folder(tmp_path / "photos", photos(8, size=32))
    torch.manual_seed(4)
    checkpoint = save_state(tmp_path / "m.pt", perturbed(classifier_net(3)))
    request = RecalibrationRequest(
        arch="tests.nets:classifier_net", model_kwargs={"classes": 3}, checkpoint=checkpoint, data=tmp_path / "photos",
        eval_data=tmp_path / "photos", transform={"resize": 20, "crop": 16}, workers=2, batch_size=4,
    )
    settings = settings.model_copy(update={"cpus_per_worker": 1.0})
    pool = WarmPool(idle_s=120)
    try:
        outputs = RunOutputs(int8=tmp_path / "m8.onnx", int8_options=Int8Options())
        result = recalibrate(request, settings, pool=pool, outputs=outputs)
        decoding = result.report.decoding
        # the photos are the calibration and the evaluation data: decoded once for the statistics,
        # then read again from what the ranks kept by the FP32 models' pass and the INT8 models' pass
        assert (decoding.decoded, decoding.reused) == (8, 16)
        [ranks] = idle_states(pool)
        assert [s.kept for s in ranks] == [(), ()]
        assert not list(Path(tempfile.gettempdir()).glob("bnrecal-kept-*"))
        recalibrate(request, settings, pool=pool, outputs=outputs)
        [again] = idle_states(pool)
        assert [s.pid for s in again] == [s.pid for s in ranks] and [s.kept for s in again] == [(), ()]
    finally:
        pool.close()
