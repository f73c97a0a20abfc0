"""``/v1/blobs``: streamed, content-addressed uploads and their downloads."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from api.deps import ServicesDep, TenantDep
from api.files import blob_response
from api.problems import PROBLEM_RESPONSES, problem_responses
from workers.errors import InputError, PayloadTooLargeError

router = APIRouter(prefix="/v1/blobs", tags=["blobs"], responses=PROBLEM_RESPONSES)


class BlobOut(BaseModel):
    """A stored blob."""

    digest: str
    size: int


_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post(
    "",
    status_code=201,
    summary="Upload a blob (checkpoint or data)",
    openapi_extra=_UPLOAD_BODY,
    responses=problem_responses(413),
)
async def upload_blob(request: Request, response: Response, tenant: TenantDep, services: ServicesDep) -> BlobOut:
    """Store the raw request body, streamed to disk while hashed; the same bytes give the same digest.

    The size cap (``BNRECAL_MAX_UPLOAD_BYTES``) is enforced on the bytes received, so a
    wrong or missing ``Content-Length`` changes nothing.
    """
    cap = services.settings.max_upload_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        services.metrics.uploads_rejected.inc()
        raise PayloadTooLargeError(
            f"upload of {declared} bytes exceeds the limit of {cap} bytes (BNRECAL_MAX_UPLOAD_BYTES)"
        )
    try:
        info = await services.blobs.ingest(tenant, request.stream(), cap)
    except PayloadTooLargeError:
        services.metrics.uploads_rejected.inc()
        raise
    except ClientDisconnect:
        raise InputError("upload interrupted: the client disconnected before the end of the body") from None
    services.metrics.upload_bytes.inc(info.size)
    response.headers["Location"] = f"/v1/blobs/{info.digest}"
    return BlobOut(digest=info.digest, size=info.size)


@router.get("/{digest}", summary="Download a blob", response_class=Response)
def download_blob(digest: str, request: Request, tenant: TenantDep, services: ServicesDep) -> Response:
    """The blob's bytes, with ``ETag`` = its digest."""
    return blob_response(request, services.blobs.path(tenant, digest), digest)


@router.head("/{digest}", summary="Check a blob exists", response_class=Response)
def head_blob(digest: str, request: Request, tenant: TenantDep, services: ServicesDep) -> Response:
    """Headers only: size (``Content-Length``) and ``ETag``; 404 if this key has no such blob."""
    return blob_response(request, services.blobs.path(tenant, digest), digest)
