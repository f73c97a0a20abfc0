"""``/v1/jobs``: submit, inspect, follow (Server-Sent Events), cancel, and download artifacts."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from bnrecal.api.deps import ServicesDep, TenantDep
from bnrecal.api.files import blob_response
from bnrecal.api.json_body import JsonBodyRoute
from bnrecal.api.problems import PROBLEM_RESPONSES, problem_responses
from bnrecal.service.jobserver.jobs.events import job_event_stream, tenant_event_stream
from bnrecal.service.jobserver.records.spec import JobSpec
from bnrecal.service.jobserver.records.views import JobList, JobStatus, JobView

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=PROBLEM_RESPONSES, route_class=JsonBodyRoute)

_CONFLICT = problem_responses(409)


class DryRun(BaseModel):
    """The answer to ``POST /v1/jobs?dry_run=true``: the spec passed every check a submission
    gets; ``spec`` is what would be stored (every default filled in). No job was created."""

    valid: bool
    spec: dict[str, Any]


_DRY_RUN_HELP = (
    "Only check the spec, as completely as a submission (its blobs, model, data and the cluster): "
    "200 with the spec as it would be stored, or the same 4xx; no job is created or queued."
)


@router.post(
    "",
    status_code=202,
    summary="Submit a recalibration job",
    responses=problem_responses(409, 429) | {200: {"model": DryRun, "description": "dry_run: the spec is valid"}},
)
def submit_job(
    spec: JobSpec,
    response: Response,
    tenant: TenantDep,
    services: ServicesDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255)] = None,
    dry_run: Annotated[bool, Query(description=_DRY_RUN_HELP)] = False,
) -> JobView:
    """Queue a job; ``Location`` names it. A retry with the same ``Idempotency-Key`` returns the same job.

    429 when the key already has ``BNRECAL_TENANT_MAX_QUEUED_JOBS`` queued jobs. With
    ``dry_run=true`` only the checks run (200, or the 4xx a submission would get)."""
    if dry_run:
        checked = DryRun(valid=True, spec=services.check(tenant, spec).model_dump(mode="json"))
        return JSONResponse(checked.model_dump(mode="json"), status_code=200)  # type: ignore[return-value]
    job, created = services.submit(tenant, spec, idempotency_key)
    if not created:
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return services.view(job)


@router.get("", summary="List jobs")
def list_jobs(
    tenant: TenantDep,
    services: ServicesDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[
        str | None, Query(max_length=64, description="The next_cursor of the previous page: the jobs older than it.")
    ] = None,
) -> JobList:
    """This key's jobs (of one ``status`` if given), newest first, ``limit`` at most; when
    there may be more, ``next_cursor`` is set: pass it as ``cursor`` for the next page."""
    jobs = services.ledger.list(tenant, status, limit, before=cursor)
    next_cursor = jobs[-1].id if len(jobs) == limit else None
    return JobList(jobs=[services.view(job) for job in jobs], next_cursor=next_cursor)


@router.get(
    "/events",
    summary="Follow all of this key's jobs (Server-Sent Events)",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "ready, then job and deleted events"},
        **problem_responses(429),
    },
)
async def tenant_events(request: Request, tenant: TenantDep, services: ServicesDep) -> StreamingResponse:
    """One stream for every job of this key: a ``ready`` event, then a ``job`` event (the job
    resource) each time one of the key's jobs is created or changes, and a ``deleted`` event
    (``{"id"}``) when one is deleted. List the jobs after ``ready`` (and after a reconnect).
    At most ``MAX_TENANT_STREAMS`` (8) open per key at once: 429 past it."""
    listener = services.feed.open_tenant(tenant)
    stream = tenant_event_stream(
        tenant, listener, services.ledger, services.feed, services.view, request.is_disconnected
    )
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream, media_type="text/event-stream", headers=headers)


@router.get("/{job_id}", summary="Get a job")
def get_job(job_id: str, tenant: TenantDep, services: ServicesDep) -> JobView:
    """Status, progress, error, artifacts and report of a job."""
    return services.view(services.ledger.get(tenant, job_id))


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
    return services.view(services.cancel(tenant, job_id))


@router.delete("/{job_id}", status_code=204, summary="Delete a finished job", responses=_CONFLICT)
def delete_job(job_id: str, tenant: TenantDep, services: ServicesDep) -> Response:
    """Delete a job that has ended, and its artifacts (unless another job references the same
    bytes); 409 while it is queued or running (cancel it first). Its input blobs stay."""
    services.delete_job(tenant, job_id)
    return Response(status_code=204)


@router.get(
    "/{job_id}/artifacts/{name:path}",
    summary="Download an artifact (checkpoint, onnx, report; a sweep's sweep, archive, <model>/<set>/...)",
    response_class=Response,
    responses=_CONFLICT,
)
def download_artifact(job_id: str, name: str, request: Request, tenant: TenantDep, services: ServicesDep) -> Response:
    """The artifact file, with ``ETag`` = its digest; checked against it as it is sent. A
    sweep's cell's files (``<model>/<set>/checkpoint``, ...) as soon as the cell is done."""
    artifact = services.artifact(tenant, job_id, name)
    return blob_response(
        request, services.blobs, tenant, artifact.digest, artifact.path, artifact.media_type, artifact.filename
    )
