"""Whether a job could ever be placed on the cluster as it is, told at submission.

A job whose ranks need more CPUs or GPUs than the cluster has (or ``cuda`` on a cluster
without GPUs) would otherwise be queued, wait up to ``BNRECAL_PLACEMENT_TIMEOUT_S`` for a
placement that cannot happen, and hold up the jobs behind it meanwhile. Ray places each
rank as one bundle on one node, so the count that matters is how many bundles each alive
node can hold, under the job's placement strategy. The check is against the cluster as it
is now: an operator whose cluster autoscales to fit turns it off (``BNRECAL_CAPACITY_CHECK``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import ray

from bnrecal.errors import SpecError

from bnrecal.service.run.options import RunOptions
from bnrecal.service.run.recalibrate import rank_resources

from bnrecal.service.settings import Settings

log = logging.getLogger("bnrecal.capacity")

_EPSILON = 1e-9
ASK_TIMEOUT_S = 5.0  # a GCS that does not answer the node table in this long is unreachable
_HINT = "checked against the cluster as it is now (BNRECAL_CAPACITY_CHECK)"


@dataclass(frozen=True)
class Node:
    """What one alive node of the cluster offers to ranks."""

    cpus: float
    gpus: float

    def bundles(self, cpus: float, gpus: float) -> int:
        """How many ranks of ``cpus`` CPUs and ``gpus`` GPUs this node holds at once."""
        fits = [math.floor(have / need + _EPSILON) for have, need in ((self.cpus, cpus), (self.gpus, gpus)) if need > 0]
        return min(fits) if fits else 1_000_000


def cluster_nodes(timeout_s: float = ASK_TIMEOUT_S) -> list[Node]:
    """The alive nodes of the connected Ray cluster and their CPUs and GPUs.

    Asked through the driver's GCS client, which raises when the call fails. ``ray.nodes()``
    goes through Ray's global state accessor, which aborts the whole process when the GCS goes
    away mid-call (a ``RpcError: CANCELLED`` check in its callback). The server's health probe
    asks twice a second, and a signal to the server's process group ends the GCS while the server
    drains, so one probe in that moment killed the server before it could queue its running
    jobs again."""
    from ray._private.worker import global_worker
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    infos = global_worker.gcs_client.get_all_node_info(timeout=timeout_s)
    return [
        Node(float(node.resources_total.get("CPU", 0.0)), float(node.resources_total.get("GPU", 0.0)))
        for node in infos.values() if node.state == GcsNodeInfo.ALIVE
    ]


def check_fits_cluster(options: RunOptions, settings: Settings, nodes: list[Node] | None = None) -> None:
    """Refuse (a ``SpecError`` naming the field) a job whose ranks the cluster as it is cannot
    place: ``cuda`` without GPUs, a rank bigger than every node, more ranks than the nodes
    hold in all, or than one node holds (``strict_pack``), or than there are nodes with room
    (``strict_spread``). Skipped when ``BNRECAL_CAPACITY_CHECK`` is off or Ray cannot be asked
    (the job then waits for its placement as before). ``nodes``: the cluster as the server
    last saw it (``cluster_health``), so that a submission never waits on Ray itself."""
    if not settings.capacity_check:
        return
    if nodes is not None:
        check_fits(options, settings, nodes, *rank_resources(settings, options))
        return
    if not ray.is_initialized():
        return
    try:
        nodes = cluster_nodes()
    except Exception:  # noqa: BLE001 - an unreachable cluster is /readyz's to report, not a bad spec
        log.warning("could not read the cluster's resources; job accepted unchecked", exc_info=True)
        return
    check_fits(options, settings, nodes, *rank_resources(settings, options))


def check_fits(options: RunOptions, settings: Settings, nodes: list[Node], cpus: float, gpus: float) -> None:
    """:func:`check_fits_cluster` for given ``nodes`` and ranks of ``cpus`` CPUs and ``gpus`` GPUs."""
    workers = options.workers
    total_cpus, total_gpus = sum(node.cpus for node in nodes), sum(node.gpus for node in nodes)
    has = f"the cluster has {total_cpus:g} CPUs and {total_gpus:g} GPUs on {len(nodes)} node(s)"
    if gpus > 0 and total_gpus <= 0:
        raise SpecError(f"device: cuda, but the cluster has no GPU ({has}); use device cpu; {_HINT}", field="device")
    per_node = [node.bundles(cpus, gpus) for node in nodes]
    rank = f"{cpus:g} CPUs" + (f" and {gpus:g} GPUs" if gpus else "")
    if max(per_node, default=0) == 0:
        most_cpus = max((node.cpus for node in nodes), default=0.0)
        most_gpus = max((node.gpus for node in nodes), default=0.0)
        short_of_gpus = gpus > 0 and most_gpus + _EPSILON < gpus
        field, setting = ("device", "BNRECAL_GPUS_PER_WORKER") if short_of_gpus else ("workers", "BNRECAL_CPUS_PER_WORKER")
        raise SpecError(
            f"{field}: each rank takes {rank} ({setting}), more than any one node has (at most {most_cpus:g} CPUs "
            f"and {most_gpus:g} GPUs; {has}); {_HINT}",
            field=field,
        )
    strategy = (options.placement or settings.placement_strategy).lower()
    if strategy == "strict_pack" and workers > max(per_node):
        raise SpecError(
            f"placement: strict_pack puts all {workers} ranks of {rank} on one node, but the largest holds "
            f"{max(per_node)} ({has}); use pack or spread, or at most {max(per_node)} workers; {_HINT}",
            field="placement",
        )
    if strategy == "strict_spread" and workers > sum(1 for count in per_node if count):
        room = sum(1 for count in per_node if count)
        raise SpecError(
            f"placement: strict_spread puts each of the {workers} ranks on its own node, but {room} node(s) have "
            f"room for a rank of {rank} ({has}); use spread, or at most {room} workers; {_HINT}",
            field="placement",
        )
    if workers > sum(per_node):
        need = f"{cpus * workers:g} CPUs" + (f" and {gpus * workers:g} GPUs" if gpus else "")
        raise SpecError(
            f"workers: {workers} ranks of {rank} each need {need}, but {has}, room for {sum(per_node)} such ranks; "
            f"use at most {sum(per_node)} workers; {_HINT}",
            field="workers",
        )
