"""``/v1/jobs``: submit, inspect, follow (Server-Sent Events), cancel, and download artifacts."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.deps import ServicesDep, TenantDep
from api.files import blob_response
from api.json_body import JsonBodyRoute
from api.problems import PROBLEM_RESPONSES, problem_responses
from service.events import job_event_stream
from service.jobs import JobList, JobSpec, JobStatus, JobView

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=PROBLEM_RESPONSES, route_class=JsonBodyRoute)

_CONFLICT = problem_responses(409)


@router.post("", status_code=202, summary="Submit a recalibration job", responses=problem_responses(409, 429))
def submit_job(
    spec: JobSpec,
    response: Response,
    tenant: TenantDep,
    services: ServicesDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255)] = None,
) -> JobView:
    """Queue a job; ``Location`` names it. A retry with the same ``Idempotency-Key`` returns the same job.

    429 when the key already has ``BNRECAL_TENANT_MAX_QUEUED_JOBS`` queued jobs."""
    job, created = services.submit(tenant, spec, idempotency_key)
    if not created:
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return job.view()


@router.get("", summary="List jobs")
def list_jobs(
    tenant: TenantDep,
    services: ServicesDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JobList:
    """This key's jobs, newest first."""
    return JobList(jobs=[job.view() for job in services.ledger.list(tenant, status, limit)])


@router.get("/{job_id}", summary="Get a job")
def get_job(job_id: str, tenant: TenantDep, services: ServicesDep) -> JobView:
    """Status, progress, error, artifacts and report of a job."""
    return services.ledger.get(tenant, job_id).view()


@router.get(
    "/{job_id}/events",
    summary="Follow a job (Server-Sent Events)",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "Events until a terminal status"}},
)
async def job_events(
    job_id: str,
    request: Request,
    tenant: TenantDep,
    services: ServicesDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=32)] = None,
) -> StreamingResponse:
    """``status`` and ``progress`` events with increasing ids; ends after the terminal status.

    With ``Last-Event-ID`` the stream resumes: it sends only what changed since that id.
    """
    await run_in_threadpool(services.ledger.get, tenant, job_id)  # 404 before the stream starts
    resume_from = int(last_event_id) if last_event_id and last_event_id.strip().isdigit() else None
    stream = job_event_stream(job_id, tenant, services.ledger, services.feed, resume_from, request.is_disconnected)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream, media_type="text/event-stream", headers=headers)


@router.post("/{job_id}/cancel", status_code=202, summary="Cancel a job", responses=_CONFLICT)
def cancel_job(job_id: str, tenant: TenantDep, services: ServicesDep) -> JobView:
    """A queued job ends ``cancelled`` at once; a running one as soon as its actors are stopped."""
    return services.cancel(tenant, job_id).view()


@router.delete("/{job_id}", status_code=204, summary="Delete a finished job", responses=_CONFLICT)
def delete_job(job_id: str, tenant: TenantDep, services: ServicesDep) -> Response:
    """Delete a job that has ended, and its artifacts (unless another job references the same
    bytes); 409 while it is queued or running (cancel it first). Its input blobs stay."""
    services.delete_job(tenant, job_id)
    return Response(status_code=204)


@router.get(
    "/{job_id}/artifacts/{name}",
    summary="Download an artifact (checkpoint, onnx, report)",
    response_class=Response,
    responses=_CONFLICT,
)
def download_artifact(job_id: str, name: str, request: Request, tenant: TenantDep, services: ServicesDep) -> Response:
    """The artifact file, with ``ETag`` = its digest."""
    artifact = services.artifact(tenant, job_id, name)
    return blob_response(request, artifact.path, artifact.digest, artifact.media_type, artifact.filename)
