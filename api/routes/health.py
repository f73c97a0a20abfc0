"""Liveness, readiness (Ray and the ledger reachable) and Prometheus metrics."""

from __future__ import annotations

from typing import Any

import ray
from fastapi import APIRouter, Response

from bnrecal.api.deps import ServicesDep
from bnrecal.api.problems import problem_response
from bnrecal.service.jobserver.metrics import CONTENT_TYPE

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    """Answers as long as the server process serves requests."""
    return {"status": "ok"}


@router.get("/readyz", summary="Ray and the ledger are reachable", responses={503: {"description": "Not ready"}})
def readyz(services: ServicesDep) -> Any:
    """Ready when Ray answers with at least one live node and the ledger can be read, and
    not shutting down (so a load balancer stops sending it new work)."""
    try:
        if services.draining.is_set():
            raise RuntimeError("the server is shutting down (SIGTERM): it takes no new uploads or jobs")
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised")
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        if not nodes:
            raise RuntimeError("Ray has no live node")
        resources = ray.cluster_resources()
        jobs = services.ledger.count_by_status()
    except Exception as exc:  # noqa: BLE001 - any failure here means "not ready", with the reason
        detail = f"not ready: {type(exc).__name__}: {str(exc)[:200]}"
        return problem_response(
            {"type": "https://bnrecal.dev/problems/not-ready", "title": "Not ready", "status": 503, "detail": detail}
        )
    return {
        "status": "ready",
        "ray": {"nodes": len(nodes), "cpus": resources.get("CPU", 0), "gpus": resources.get("GPU", 0)},
        "jobs": {status.value: count for status, count in jobs.items()},
        "running": len(services.runner.running_jobs()),
    }


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics(services: ServicesDep) -> Response:
    """Jobs by status, samples processed, upload bytes and job seconds, in Prometheus text format."""
    return Response(services.metrics.render(), media_type=CONTENT_TYPE)
