"""Liveness, readiness (Ray and the ledger reachable) and Prometheus metrics."""

from __future__ import annotations

from typing import Any

import ray
from fastapi import APIRouter, Response

from bnrecal.api.deps import ServicesDep
from bnrecal.api.problems import problem_response
from bnrecal.service.jobserver.metrics import CONTENT_TYPE
from bnrecal.service.jobserver.problems import Problem

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    """Answers as long as the server process serves requests."""
    return {"status": "ok"}


@router.get("/readyz", summary="Ray and the ledger are reachable", responses={503: {"description": "Not ready"}})
def readyz(services: ServicesDep) -> Any:
    """Ready when Ray answers with at least one live node and the ledger can be read, and
    not shutting down (so a load balancer stops sending it new work). Ray is never asked
    here: the server's prober keeps its last answer, and one older than 1.5 s (a cluster
    that stopped answering) is 503 (docs/api.md, "Operations")."""
    try:
        if services.draining.is_set():
            raise RuntimeError("the server is shutting down (SIGTERM): it takes no new uploads or jobs")
        if services.health is not None:
            state = services.health.state()
            if not state.reachable:
                raise RuntimeError(state.reason)
            nodes, cpus, gpus = len(state.nodes), state.cpus, state.gpus
        else:
            nodes, cpus, gpus = _ask_ray()
        jobs = services.ledger.count_by_status()
    except Exception as exc:  # noqa: BLE001 - any failure here means "not ready", with the reason
        detail = f"not ready: {type(exc).__name__}: {str(exc)[:300]}"
        return problem_response(
            Problem(type="https://bnrecal.dev/problems/not-ready", title="Not ready", status=503, detail=detail)
        )
    return {
        "status": "ready",
        "ray": {"nodes": nodes, "cpus": cpus, "gpus": gpus},
        "jobs": {status.value: count for status, count in jobs.items()},
        "running": len(services.runner.running_jobs()),
    }


def _ask_ray() -> tuple[int, float, float]:
    """Nodes, CPUs and GPUs asked of Ray itself (services without a prober)."""
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised")
    alive = [node for node in ray.nodes() if node.get("Alive")]
    if not alive:
        raise RuntimeError("Ray has no live node")
    resources = ray.cluster_resources()
    return len(alive), resources.get("CPU", 0), resources.get("GPU", 0)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics(services: ServicesDep) -> Response:
    """Jobs by status, samples processed, upload bytes and job seconds, in Prometheus text format."""
    return Response(services.metrics.render(), media_type=CONTENT_TYPE)
