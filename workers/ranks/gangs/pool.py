"""Warm rank actors kept between jobs, so a small job does not pay for start-up.

Starting a rank actor means a new Python process that imports torch: seconds, most of
a small job's time. A :class:`WarmPool` keeps the actors of a finished job, with the
placement group that reserves their resources, as one *gang*, keyed by everything that
makes it reusable (:class:`GangKey`: world size, CPUs and GPUs per rank, placement
strategy, device). A later job of the same shape takes the gang instead of starting one.

Why whole gangs and not single actors: ``ray.util.collective``'s GLOO groups run over
torch's default process group, which a process can form only once, with the peers and
ranks of its first job. A per-job group (a fresh name, destroyed after the job) is then
a subgroup of that world, so it is safe only when the same processes keep the same
ranks, which a gang guarantees. A gang is also placed as one group, so the job's
placement strategy (``STRICT_SPREAD`` over nodes, say) holds for reused actors too.

Only a healthy gang serves again: one whose job succeeded and whose every rank answers
:meth:`CalibrationRank.reset` in time (no collective group left, state cleared; the
reset runs while the finished job is written out and is checked when the next job takes
the gang). A cancelled or failed job's gang is killed. Idle gangs are killed after ``idle_s``
(their CPUs go back to the cluster), and any of them is evicted, oldest first, when a
new gang needs the resources it holds: at once for a job of the pool's own process, within
a second for a placement group of any other process of the cluster (another server's job
host, a caller's run), which waits for no pool's ``idle_s``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from bnrecal.errors import CancelledError, RunError
from bnrecal.workers.ranks.process.actor import CalibrationActor
from bnrecal.workers.ranks.process.allocator import RANK_ENV_VARS
from bnrecal.workers.ranks.process.start_up import RANK_PROCESS

if TYPE_CHECKING:
    from bnrecal.workers.ranks.plan import GroupOptions

log = logging.getLogger("bnrecal.pool")

RESET_TIMEOUT_S = 10.0
"""Longest a rank may take to confirm it is clean before its gang goes back to the pool."""


@dataclass(frozen=True)
class GangKey:
    """What makes a gang reusable by a job: two jobs with equal keys can share actors."""

    world_size: int
    cpus_per_worker: float
    gpus_per_worker: float
    placement_strategy: str
    device: str

    @classmethod
    def of(cls, world_size: int, device: str, options: GroupOptions) -> GangKey:
        """The key of ``world_size`` ranks on ``device``, placed by ``options``."""
        return cls(world_size, options.cpus_per_worker, options.gpus_per_worker, options.placement_strategy, device)

    @property
    def bundle(self) -> dict[str, float]:
        """The resources one rank reserves."""
        bundle = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker
        return bundle

    @property
    def threads(self) -> int:
        """Torch threads per rank: one per whole CPU it holds."""
        return max(1, int(self.cpus_per_worker))


@dataclass(eq=False)
class Gang:
    """The K rank actors of one job and the placement group that reserves their resources."""

    key: GangKey
    group: Any
    actors: list[Any] = field(default_factory=list)
    jobs: int = 0
    idle_since: float = 0.0
    resetting: list[Any] = field(default_factory=list)

    @classmethod
    def start(cls, key: GangKey, placement_timeout_s: float, cancel: threading.Event | None, name: str = "") -> Gang:
        """Reserve the ranks' resources (in a placement group called ``name``) and start their
        actors (not waiting for them to be up: the job notices their start-up, and a cancel
        during it, as it follows their events)."""
        group = placement_group(
            [dict(key.bundle) for _ in range(key.world_size)], strategy=key.placement_strategy, name=name
        )
        gang = cls(key, group)
        try:
            _wait_for_placement(group, key, placement_timeout_s, cancel)
            for rank in range(key.world_size):
                gang.actors.append(
                    CalibrationActor.options(
                        num_cpus=key.cpus_per_worker,
                        num_gpus=key.gpus_per_worker,
                        max_restarts=0,
                        max_task_retries=0,
                        runtime_env={"env_vars": {**RANK_ENV_VARS, **RANK_PROCESS}},
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=group, placement_group_bundle_index=rank
                        ),
                    ).remote(rank, key.threads)
                )
        except BaseException:
            gang.kill()
            raise
        return gang

    def kill(self) -> None:
        """Kill the actors and give the reserved resources back to the cluster."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        try:
            remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 - already removed
            pass

    def start_reset(self) -> None:
        """Ask every rank to clear what its job left; the answers are awaited in :meth:`is_clean`,
        so the reset runs in the ranks while the finished job is written out."""
        self.resetting = [actor.reset.remote() for actor in self.actors]

    def is_clean(self, timeout: float = RESET_TIMEOUT_S, cancel: threading.Event | None = None) -> bool:
        """Whether every rank is alive and confirmed its reset (no collective group left)
        within ``timeout``; False at once when ``cancel`` is set meanwhile."""
        deadline = time.monotonic() + timeout
        pings = [actor.node.remote() for actor in self.actors]  # and alive now: one may have died idle
        refs = self.resetting + pings
        try:
            while True:
                _, pending = ray.wait(refs, num_returns=len(refs), timeout=0.2)
                if not pending:
                    ray.get(pings)  # raises for a rank that died
                    return all(ray.get(self.resetting))
                if (cancel is not None and cancel.is_set()) or time.monotonic() >= deadline:
                    return False
        except Exception:  # noqa: BLE001 - a rank that cannot answer is not reusable
            log.warning("a warm rank failed its reset; its gang is killed", exc_info=True)
            return False


@contextmanager
def held_gang(key: GangKey, options: GroupOptions, pool: Any = None,
              cancel: threading.Event | None = None) -> Iterator[Gang]:
    """A gang for ``key`` while the block runs: the job's or a warm one from ``pool`` (a
    ``WarmPool`` or a ``JobGang``), else one started now. It goes back to ``pool`` when the
    block succeeds; a block that fails or is cancelled leaves it in an unknown state (a rank
    mid-step, a broken collective group), so it is killed."""
    gang = pool.take(key, cancel) if pool is not None and pool.enabled else None
    if gang is None:
        gang = Gang.start(key, options.placement_timeout_s, cancel, name=pool.group_name() if pool is not None else "")
    try:
        yield gang
    except BaseException:
        gang.kill()
        raise
    if pool is not None:
        pool.give_back(gang)
    else:
        gang.kill()


_OPEN_POOLS: weakref.WeakSet[WarmPool] = weakref.WeakSet()


class WarmPool:
    """Idle gangs of rank actors, reused by jobs of the same :class:`GangKey`.

    ``idle_s`` is how long an idle gang is kept (0 keeps none: every job starts its own
    actors). The pool holds at most what the cluster can reserve, and gives way to any
    job that needs its resources. With a ``group_prefix``, the placement groups of the
    gangs its jobs start are named with it, so that whoever outlives this process can
    remove them (a placement group outlives the actor that made it).
    """

    def __init__(self, idle_s: float, group_prefix: str = "") -> None:
        self.idle_s = idle_s
        self.group_prefix = group_prefix
        self._idle: list[Gang] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None
        if idle_s > 0:
            self._reaper = threading.Thread(target=self._reap_loop, name="bnrecal-warm-pool", daemon=True)
            self._reaper.start()
        _OPEN_POOLS.add(self)

    def group_name(self) -> str:
        """A fresh name for a new gang's placement group (empty without a prefix)."""
        return f"{self.group_prefix}{uuid.uuid4().hex[:12]}" if self.group_prefix else ""

    @property
    def enabled(self) -> bool:
        """Whether finished gangs are kept at all."""
        return self.idle_s > 0 and not self._closed.is_set()

    def take(self, key: GangKey, cancel: threading.Event | None = None) -> Gang | None:
        """An idle gang for ``key`` (the most recently used) whose ranks confirmed their
        reset, or None: then the job starts one. A gang that failed its reset (or whose
        check a cancel interrupted) is killed."""
        while True:
            with self._lock:
                gang = next((g for g in reversed(self._idle) if g.key == key), None)
                if gang is None:
                    return None
                self._idle.remove(gang)
            if gang.is_clean(cancel=cancel):
                return gang
            gang.kill()

    def give_back(self, gang: Gang) -> bool:
        """Keep a gang whose job succeeded (its ranks reset themselves meanwhile, checked
        before the next job takes it); with the pool off or closed, kill it."""
        if not self.enabled:
            gang.kill()
            return False
        gang.start_reset()
        gang.jobs += 1
        gang.idle_since = time.monotonic()
        with self._lock:
            if not self._closed.is_set():
                self._idle.append(gang)
                return True
        gang.kill()
        return False

    def idle(self) -> list[Gang]:
        """The idle gangs, oldest first (a copy)."""
        with self._lock:
            return list(self._idle)

    def idle_resources(self) -> dict[str, float]:
        """CPUs and GPUs the idle gangs hold reserved."""
        held = {"CPU": 0.0, "GPU": 0.0}
        for gang in self.idle():
            held["CPU"] += gang.key.cpus_per_worker * gang.key.world_size
            held["GPU"] += gang.key.gpus_per_worker * gang.key.world_size
        return held

    def evict_for(self, need: dict[str, float]) -> int:
        """Kill idle gangs, oldest first, until ``need`` fits beside what the cluster has free; returns how many."""
        available = ray.available_resources()
        free = {name: available.get(name, 0.0) for name in need}
        evicted = 0
        while any(free[name] + 1e-9 < amount for name, amount in need.items()):
            with self._lock:
                if not self._idle:
                    break
                gang = self._idle.pop(0)
            for name in free:
                per_rank = gang.key.bundle.get(name, 0.0)
                free[name] += per_rank * gang.key.world_size
            gang.kill()
            evicted += 1
        return evicted

    def give_way(self) -> int:
        """Kill idle gangs, oldest first, while a placement group of any process of the cluster
        (another server's job host, a caller's run, another driver) waits for resources they
        hold; returns how many. A job of this process asks at once (``make_room``); this is how
        the pools of other processes hear it, within a reaper interval, instead of only after
        ``idle_s``. A group that no eviction could place (infeasible) is not waited for."""
        if not self.idle():  # an idle gang's own group is placed, never pending
            return 0
        need: dict[str, float] = {}
        for group in placement_group_table().values():
            if group.get("state") != "PENDING" or group.get("stats", {}).get("scheduling_state") != "NO_RESOURCES":
                continue
            for bundle in group.get("bundles", {}).values():
                for name, amount in bundle.items():
                    if name in ("CPU", "GPU"):
                        need[name] = need.get(name, 0.0) + amount
        return self.evict_for(need) if need else 0

    def reap(self, now: float | None = None) -> int:
        """Kill the gangs idle for longer than ``idle_s``; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [gang for gang in self._idle if now - gang.idle_since >= self.idle_s]
            self._idle = [gang for gang in self._idle if gang not in old]
        for gang in old:
            gang.kill()
        return len(old)

    def close(self) -> None:
        """Kill every idle gang and keep none from now on (gangs still in use die with their jobs)."""
        self._closed.set()
        with self._lock:
            idle, self._idle = self._idle, []
        for gang in idle:
            gang.kill()
        if self._reaper is not None and self._reaper is not threading.current_thread():
            self._reaper.join(5.0)
        _OPEN_POOLS.discard(self)

    def _reap_loop(self) -> None:
        interval = min(1.0, self.idle_s / 4)
        while not self._closed.wait(interval):
            try:
                self.reap()
                self.give_way()
            except Exception:  # noqa: BLE001 - the reaper must outlive a bad moment (Ray restarting)
                log.exception("releasing idle warm actors failed; retrying")


def make_room(need: dict[str, float]) -> None:
    """Evict idle gangs of this process's pools until ``need`` fits in the cluster's free resources."""
    for pool in list(_OPEN_POOLS):
        pool.evict_for(need)


def _wait_for_placement(
    group: Any, key: GangKey, placement_timeout_s: float, cancel: threading.Event | None
) -> None:
    """Wait until the cluster holds the ranks' bundles; a cancel is noticed within a fraction of a second.

    Idle warm gangs of this process that hold the resources are evicted to make room.
    """
    need = {name: amount * key.world_size for name, amount in key.bundle.items()}
    ready = group.ready()
    deadline = time.monotonic() + placement_timeout_s
    next_eviction = time.monotonic()
    while True:
        if cancel is not None and cancel.is_set():
            raise CancelledError("the job was cancelled while waiting for its workers' resources")
        done, _ = ray.wait([ready], timeout=min(0.2, max(0.0, deadline - time.monotonic())))
        if done:
            ray.get(done[0])
            return
        if time.monotonic() >= next_eviction:  # not placed yet: idle gangs may hold what it needs
            make_room(need)
            next_eviction = time.monotonic() + 1.0
        if time.monotonic() >= deadline:
            break
    available = ray.available_resources()
    raise RunError(
        f"could not place {key.world_size} workers of {key.bundle} within {placement_timeout_s:.0f} s "
        f"(cluster has CPU={available.get('CPU', 0):g}, GPU={available.get('GPU', 0):g} free): "
        "use fewer workers, lower BNRECAL_CPUS_PER_WORKER, or raise BNRECAL_PLACEMENT_TIMEOUT_S"
    )
