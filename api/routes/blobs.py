"""``/v1/blobs``: streamed, content-addressed uploads and their downloads."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.requests import ClientDisconnect

from bnrecal.api.deps import ServicesDep, TenantDep
from bnrecal.api.files import blob_response
from bnrecal.api.problems import PROBLEM_RESPONSES, problem_responses
from bnrecal.service.jobserver.storage.blobs import MAX_FILENAME_CHARS, BlobInfo
from bnrecal.errors import InputError

router = APIRouter(prefix="/v1/blobs", tags=["blobs"], responses=PROBLEM_RESPONSES)


_FILENAME_HELP = (
    "The name of the uploaded file (e.g. calib.npy), shown in the errors of jobs that use the blob "
    "instead of its digest. Only its last path component is kept, without control characters."
)
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
    responses=problem_responses(413, 507),
)
async def upload_blob(
    request: Request,
    response: Response,
    tenant: TenantDep,
    services: ServicesDep,
    filename: Annotated[str | None, Query(max_length=MAX_FILENAME_CHARS, description=_FILENAME_HELP)] = None,
) -> BlobInfo:
    """Store the raw request body, streamed to disk while hashed; the same bytes give the same digest.

    The size cap (``BNRECAL_MAX_UPLOAD_BYTES``) and the key's storage quota
    (``BNRECAL_TENANT_QUOTA_BYTES``, 413) are enforced on the bytes received, so a wrong or
    missing ``Content-Length`` changes nothing; a full disk is a 507 that keeps nothing. ``filename`` is only a display
    name for the errors of jobs that use the blob; it never names a file on the server.
    """
    declared = request.headers.get("content-length", "")
    try:
        size = int(declared) if declared.isdigit() else None
        info = await services.upload(tenant, request.stream(), size, filename)
    except ClientDisconnect:
        raise InputError("upload interrupted: the client disconnected before the end of the body") from None
    response.headers["Location"] = f"/v1/blobs/{info.digest}"
    return info  # the stored blob, as the client reads it back (BlobInfo)


@router.get("/{digest}", summary="Download a blob", response_class=Response)
def download_blob(digest: str, request: Request, tenant: TenantDep, services: ServicesDep) -> Response:
    """The blob's bytes, with ``ETag`` = its digest; checked against it as they are sent (a
    damaged blob is quarantined and the download cut off before it completes)."""
    return blob_response(request, services.blobs, tenant, digest, services.blobs.path(tenant, digest))


@router.head("/{digest}", summary="Check a blob exists", response_class=Response)
def head_blob(digest: str, request: Request, tenant: TenantDep, services: ServicesDep) -> Response:
    """Headers only: size (``Content-Length``) and ``ETag``; 404 if this key has no such blob
    (or it was found damaged and quarantined: upload it again)."""
    return blob_response(request, services.blobs, tenant, digest, services.blobs.path(tenant, digest))


@router.delete("/{digest}", status_code=204, summary="Delete a blob", responses=problem_responses(409))
def delete_blob(digest: str, tenant: TenantDep, services: ServicesDep) -> Response:
    """Delete the blob (and its unpacked archive); 409 while a queued or running job uses it.

    A finished job that used it keeps its record; its artifact download answers 404 if the
    blob was one of its artifacts.
    """
    services.delete_blob(tenant, digest)
    return Response(status_code=204)
