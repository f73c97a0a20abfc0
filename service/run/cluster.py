"""Connecting to Ray: an existing cluster by address, or an embedded local instance.

An embedded instance is never open to the network: every Ray process of it listens on
loopback only, and it runs with Ray's token authentication, its token a fresh random
secret known only to its own processes (they inherit it through the environment).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray._private import ray_constants

from bnrecal.errors import RunError

_logger = logging.getLogger(__name__)

EMBEDDED_ADDRESSES = ("", "local")
"""Addresses that mean "start an instance of our own" (``RAY_ADDRESS=local`` included)."""

LEAN_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                      "enable_metrics_collection": False}
"""An embedded instance starts what a run needs and no more: no idle task workers started
ahead (a run's ranks are actors, each a process of its own), no metrics collection."""

_LOOPBACK_SWITCH = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR  # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
_AUTH_ENV = ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")
_caller_auth_env: dict[str, str | None] | None = None  # what the embedded instance replaced


def ensure_ray(address: str | None = None, *, min_cpus: float = 0) -> bool:
    """Make sure this process is connected to Ray; return True if it started a local instance.

    With an address (or ``RAY_ADDRESS``) it joins that cluster, authenticating with the
    token Ray finds in this process's environment (``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN``).
    Without one (or with ``local``), it starts an embedded local instance sized to at least
    ``min_cpus`` logical CPUs, whose workers see the driver's ``sys.path`` so user model
    modules import there too; that instance listens on loopback only and requires a fresh
    token (see :func:`_embedded_auth`).
    """
    with _STARTING:  # threads of one process (a sweep's lanes) start or join one Ray, once
        return _ensure_ray(address, min_cpus)


_STARTING = threading.Lock()


def _ensure_ray(address: str | None, min_cpus: float) -> bool:
    if ray.is_initialized():
        return False
    _ray_messages_to_stderr()
    address = address or os.environ.get("RAY_ADDRESS") or ""
    try:
        if address not in EMBEDDED_ADDRESSES:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            return False
        _start_embedded(max(float(os.cpu_count() or 1), float(min_cpus)))
        return True
    except ConnectionError as exc:
        raise RunError(f"cannot reach the Ray cluster at {address!r}: {exc}; check --ray-address / RAY_ADDRESS") from exc


EMBEDDED_START_ATTEMPTS = 2
"""Starts of the embedded instance tried before giving up. Ray waits a fixed 30 s for its
raylet to register with the GCS and then fails the start ("timed out during startup"); on a
loaded small machine (two cores running exports beside it) that can pass once."""

_START_TIMED_OUT = "timed out during startup"  # what Ray's Node says when its raylet did not register in time


def _start_embedded(num_cpus: float) -> None:
    """Start the embedded instance (loopback only, a fresh token each attempt); a start that
    timed out is cleared (every process holding its token killed) and tried once more."""
    for attempt in range(1, EMBEDDED_START_ATTEMPTS + 1):
        _embedded_auth()
        try:
            with _loopback_only():
                ray.init(
                    address="local",  # a new instance of our own, never one another process left running
                    num_cpus=int(num_cpus + 0.999),
                    include_dashboard=False,
                    _system_config=LEAN_SYSTEM_CONFIG,
                    _node_ip_address="127.0.0.1",
                    logging_level=logging.ERROR,
                    log_to_driver=False,
                    runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}},
                )
            _stop_log_monitor()
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for a start that timed out
            if _START_TIMED_OUT not in str(exc):
                raise
            ray.shutdown()
            _reap([], os.environ.get("RAY_AUTH_TOKEN"))  # the failed start's GCS, raylet and agents
            if attempt == EMBEDDED_START_ATTEMPTS:
                raise RunError(f"the embedded Ray did not start: its raylet did not register in time, "
                               f"{attempt} times (is the machine overloaded?)") from exc
            _logger.warning("the embedded Ray's raylet did not register in time; starting it again")



def _ray_messages_to_stderr() -> None:
    """Make Ray print the errors it pushes to the driver ("A worker died or was killed...")
    on stderr: it prints them on stdout, which carries only a command's own output (a job
    id, ``--json``; docs/python.md). Ray's listener thread looks the printer up by name at
    each message, so replacing it in Ray's module is enough; once per process."""
    from ray._private import worker as ray_worker

    printer = ray_worker.print_to_stdstream
    if getattr(printer, "bnrecal_stderr", False):
        return

    def on_stderr(data: dict[str, Any], ignore_prefix: bool) -> None:
        printer({**data, "is_err": True}, ignore_prefix)

    on_stderr.bnrecal_stderr = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = on_stderr


def _embedded_auth() -> None:
    """Require token authentication on the embedded instance, with a token of its own.

    Ray 2.60 turns token auth on for a new ``ray.init()`` cluster unless ``RAY_AUTH_MODE``
    says otherwise, but its token is then the one in ``~/.ray/auth_token``: shared by every
    instance of this user, kept across runs, written world-readable. Here the mode is
    forced to ``token`` (an operator's ``RAY_AUTH_MODE=disabled`` does not open the embedded
    instance) and the token is a fresh random secret per instance, in ``RAY_AUTH_TOKEN``
    (Ray's first token source): the GCS, raylet, agents and workers inherit it from this
    process; it is never written to a file or logged.
    """
    from ray._private.authentication.authentication_token_setup import _enable_token_auth
    from ray._raylet import AuthenticationTokenLoader

    global _caller_auth_env
    if _caller_auth_env is None:
        _caller_auth_env = {name: os.environ.get(name) for name in _AUTH_ENV}
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _enable_token_auth()  # RAY_AUTH_MODE=token, and this process's cached Ray config re-read
    AuthenticationTokenLoader.instance().reset_cache()  # a token an earlier instance cached


@contextmanager
def _loopback_only() -> Iterator[None]:
    """Make the instance started inside bind every listening socket to 127.0.0.1.

    Ray's C++ servers (GCS, raylet, object manager, workers) and its Python agents listen
    on loopback only when the node's address is literally 127.0.0.1, but ``ray.init``
    replaces a loopback ``_node_ip_address`` by the machine's routable address unless
    Ray's "local only" switch (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the default on
    macOS and Windows) is set. It is set for the start only: the processes started then
    inherit it, and this process afterwards joins clusters as usual.
    """
    saved_flag, saved_env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(_LOOPBACK_SWITCH)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[_LOOPBACK_SWITCH] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_LOOPBACK_SWITCH, None)
        else:
            os.environ[_LOOPBACK_SWITCH] = saved_env


def shutdown_embedded() -> None:
    """Shut down the embedded instance this process started, and give the caller's Ray
    authentication settings back: a training script that recalibrates on an embedded
    instance and then joins its own cluster must not send that cluster the dead
    instance's token."""
    from ray._raylet import AuthenticationTokenLoader, Config

    global _caller_auth_env
    token = os.environ.get("RAY_AUTH_TOKEN") if _caller_auth_env is not None else None
    instance = _instance_processes()
    _stop_monitor()
    ray.shutdown()
    _reap(instance, token)
    if _caller_auth_env is None:
        return
    for name, value in _caller_auth_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _caller_auth_env = None
    Config.initialize("")  # this process's cached Ray config re-read from the environment
    AuthenticationTokenLoader.instance().reset_cache()


def _stop_log_monitor() -> None:
    """Stop the embedded instance's log monitor as soon as it has started.

    Ray's log monitor tails every worker's log file, ten times a second, to forward their
    lines to drivers; this instance's only driver is this process, which asks for none
    (``log_to_driver=False``: a rank's output would interleave with a command's own). Its
    polling grows with the files of every worker the instance ever started: an instance up
    for half an hour, its workers started and stopped by the hundred (a test run's), spent
    about 2 CPU-minutes in it, 6% of a core, for nothing. Ray's own ``ray
    start --include-log-monitor=False`` leaves it out; ``ray.init`` has no such option, so
    it is stopped once started (it holds no state; Ray's errors still reach this process,
    over their own channel).
    """
    node = getattr(ray._private.worker, "_global_node", None)
    if node is not None and node.is_head():
        node.kill_log_monitor(check_alive=False)


def _stop_monitor() -> None:
    """Kill the embedded instance's autoscaler monitor before ``ray.shutdown``.

    Ray stops a node's processes one by one, each given a second to exit on SIGTERM; the
    monitor (the autoscaler, idle on a one-node instance that never scales) ignores it and
    always takes the whole second, a fixed second added to every call that started an
    instance. It holds no state, so it is killed outright first.
    """
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not node.is_head():
        return
    for info in node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []):
        if info.process.poll() is None:
            info.process.kill()
            info.process.wait(timeout=5)


def _instance_processes() -> list[Any]:
    """The processes of the embedded instance this process started (none when it joined a
    cluster by address): its descendants that are Ray's."""
    import psutil

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not node.is_head():
        return []
    return [child for child in psutil.Process().children(recursive=True) if _is_ray_process(child)]


def _reap(processes: list[Any], token: str | None, grace_s: float = 5.0) -> None:
    """Wait for the instance's processes to be gone after ``ray.shutdown``, then kill what is
    left: those seen before it, and any process still holding the instance's own token (one
    started while it stopped). The raylet stops its workers and agents as it exits, but on
    a loaded machine one can still be running when ``shutdown`` returns; nothing of the
    instance may outlive it with the token in its environment."""
    import psutil

    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(process) for process in processes):
        time.sleep(0.05)
    left = [process for process in processes if _alive(process)]
    if token is not None:
        seen = {process.pid for process in left}
        left += [process for process in _token_holders(token) if process.pid not in seen]
    for process in left:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)


def _token_holders(token: str) -> list[Any]:
    """This user's other processes whose environment carries ``RAY_AUTH_TOKEN=token``: an
    embedded instance's token is fresh and its own (see :func:`_embedded_auth`)."""
    import psutil

    holders = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get("RAY_AUTH_TOKEN") == token:
                holders.append(process)
        except psutil.Error:
            pass
    return holders


def embedded_gcs_process() -> Any:
    """The GCS process (a ``subprocess.Popen``) of the embedded instance this process started,
    or None (a cluster joined by address): watched to tell at once that the instance died."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not node.is_head():
        return None
    infos = node.all_processes.get(ray_constants.PROCESS_TYPE_GCS_SERVER, [])
    return infos[0].process if infos else None


def kill_embedded_processes(timeout_s: float = 1.0) -> None:
    """Kill every process of the embedded instance this process started, whatever its state:
    the GCS, raylet and monitor, and the agents and workers the raylet started (which would
    otherwise outlive a dead GCS by minutes), waiting up to ``timeout_s`` for them to be gone.
    Ray's own ``shutdown`` is not called: on a dead GCS it waits for it. The caller ends the
    process without Ray's exit handler, for the same reason."""
    import psutil
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False  # a job thread's late Ray call must not start a new instance
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not node.is_head():
        return
    doomed = _instance_processes()
    for child in doomed:
        try:
            child.kill()
        except psutil.Error:
            pass
    try:
        node.kill_all_processes(check_alive=False, allow_graceful=False)  # and reaps its own children
    except Exception:  # noqa: BLE001 - some already gone
        pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(child) for child in doomed):
        time.sleep(0.05)


def _alive(process: Any) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _is_ray_process(process: Any) -> bool:
    """A process of the embedded instance: the GCS, raylet, Ray's agents and workers (``ray::``), its Python helpers."""
    try:
        name = process.name()
        command = " ".join(process.cmdline()[:3])
    except Exception:  # noqa: BLE001 - gone meanwhile
        return False
    return name.startswith(("ray::", "gcs_server", "raylet")) or "ray/_private" in command or "ray/dashboard" in command


def is_local_instance() -> bool:
    """Whether the connected Ray cluster is a single node (like an embedded instance)."""
    return len([n for n in ray.nodes() if n.get("Alive")]) <= 1
