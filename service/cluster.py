"""Connecting to Ray: an existing cluster by address, or an embedded local instance."""

from __future__ import annotations

import logging
import os
import sys

import ray

from workers.errors import RunError


def ensure_ray(address: str | None = None, *, min_cpus: float = 0) -> bool:
    """Make sure this process is connected to Ray; return True if it started a local instance.

    With an address (or ``RAY_ADDRESS``) it joins that cluster. Without, it starts an
    embedded local instance sized to at least ``min_cpus`` logical CPUs, whose workers
    see the driver's ``sys.path`` so user model modules import there too.
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    try:
        if address:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            return False
        num_cpus = max(float(os.cpu_count() or 1), float(min_cpus))
        ray.init(
            address="local",  # a new instance of our own, never one another process left running
            num_cpus=int(num_cpus + 0.999),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",  # an embedded single-node instance listens on loopback only
            logging_level=logging.ERROR,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}},
        )
        return True
    except ConnectionError as exc:
        raise RunError(f"cannot reach the Ray cluster at {address!r}: {exc}; check --ray-address / RAY_ADDRESS") from exc


def is_local_instance() -> bool:
    """Whether the connected Ray cluster is a single node (like an embedded instance)."""
    return len([n for n in ray.nodes() if n.get("Alive")]) <= 1
