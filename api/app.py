"""The FastAPI application factory: routers, problem+json errors, and the services' lifespan.

The HTTP layer sits on top of the service core: this package imports ``service``, never
the reverse. ``bnrecal serve`` starts it by name (``api.app:create_app``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from service.server import open_services
from service.settings import Settings, get_settings

from .limits import BodySizeLimit
from .problems import install_problem_handlers
from .routes import blobs, health, jobs, pages

DESCRIPTION = (
    "Recalibrate the BatchNorm statistics of trained PyTorch models on Ray and download them, "
    "also folded to ONNX. Upload a checkpoint and calibration data to `/v1/blobs`, submit a job to "
    "`/v1/jobs`, follow `/v1/jobs/{id}/events`, then download `/v1/jobs/{id}/artifacts/{name}`."
)


def _version() -> str:
    try:
        return version("bnrecal")
    except PackageNotFoundError:
        return "0.0.0"


@contextmanager
def _server_signal_handlers_kept() -> Iterator[None]:
    """Undo Ray's SIGTERM/SIGINT handlers, which would exit at once instead of letting the
    server shut down cleanly (running jobs back to the queue)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The application for ``settings`` (default: the environment's ``BNRECAL_*``).

    Besides the API it serves the web page (``/``, ``/jobs/{id}``) and its scripts and
    styles (``/static``). Its lifespan opens the ledger, recovers jobs a crash interrupted, joins Ray and
    starts the runner; at shutdown, running jobs go back to the queue.
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # On the loop's thread on purpose: Ray wants to be started from the main thread.
        with _server_signal_handlers_kept():
            services = open_services(settings)
        app.state.services = services
        try:
            yield
        finally:
            app.state.services = None
            services.close()

    app = FastAPI(title="bnrecal", version=_version(), description=DESCRIPTION, lifespan=lifespan)
    app.add_middleware(BodySizeLimit)
    install_problem_handlers(app)
    app.include_router(health.router)
    app.include_router(blobs.router)
    app.include_router(jobs.router)
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=pages.STATIC_DIR), name="static")
    return app
