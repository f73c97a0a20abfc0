"""The web page: the jobs list with the submit form (``/``), a job's page (``/jobs/{id}``),
and the frame the HTML report is shown in (``/ui/report-frame``).

The pages are shells rendered server-side; their scripts (``api/static/``) call the
``/v1`` API with the API key kept in the browser's ``sessionStorage``, so the pages
themselves hold no tenant data and need no key. None of them is part of the API's
OpenAPI schema. Each is served with a strict Content-Security-Policy: scripts, styles
and requests only from this server, nothing inline, nothing external.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from bnrecal.api.deps import ServicesDep
from bnrecal.service.export.products import PRODUCTS

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"
STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

PAGE_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data: blob:",
        "connect-src 'self'",
        "frame-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
"""The pages' policy: everything from this origin only, no inline script or style."""

REPORT_FRAME_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'unsafe-inline'",
        "img-src data:",
        "font-src data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'self'",
    ]
)
"""The report frame's policy: the report's inline styles (matplotlib's SVG needs them) and
nothing else; the frame is sandboxed without ``allow-same-origin`` by the page that embeds
it, so what it shows can never read the page's storage or call the API."""

_SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=TEMPLATES_DIR)


def _page(request: Request, name: str, services: ServicesDep, **context: object) -> HTMLResponse:
    """Render a page with what every page's script needs: whether a key is asked for, and the root path."""
    headers = _SECURITY_HEADERS | {"Content-Security-Policy": PAGE_POLICY}
    values = {"auth": bool(services.settings.api_keys), "root": request.scope.get("root_path", "").rstrip("/")}
    return templates.TemplateResponse(request, name, values | context, headers=headers)


@router.get("/", response_class=HTMLResponse)
def jobs_page(request: Request, services: ServicesDep) -> HTMLResponse:
    """The tenant's jobs, newest first, with live progress, and the form that submits a new one
    (its exported files' checkboxes from the products table)."""
    return _page(request, "jobs.html", services, products=PRODUCTS)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: str, request: Request, services: ServicesDep) -> HTMLResponse:
    """One job: its spec, live status and progress, cancel, downloads and the HTML report.

    The page is the same for any id: whether the job exists (for this key) is the API's
    answer, which the page's script shows.
    """
    return _page(request, "job.html", services, job_id=job_id)


@router.get("/ui/report-frame", response_class=HTMLResponse)
def report_frame(request: Request) -> HTMLResponse:
    """An empty document that shows the report HTML its parent page posts to it.

    The report is fetched by the parent (it needs the key) and handed over with
    ``postMessage``; this document's own policy lets the report's inline styles apply,
    which the parent's stricter policy would block in a ``srcdoc`` or ``blob:`` frame.
    """
    headers = _SECURITY_HEADERS | {"Content-Security-Policy": REPORT_FRAME_POLICY}
    root = request.scope.get("root_path", "").rstrip("/")
    return templates.TemplateResponse(request, "report_frame.html", {"root": root}, headers=headers)
