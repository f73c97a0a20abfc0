"""The FastAPI application factory: routers, problem+json errors, and the services' lifespan.

The HTTP layer sits on top of the service core: this package imports ``service``, never
the reverse. ``bnrecal serve`` starts it by name (``api.app:create_app``).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from importlib.metadata import PackageNotFoundError, version
from types import FrameType
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from bnrecal.service.jobserver.server import Services, open_services
from bnrecal.service.settings import Settings, get_settings

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


def _hand_over(handler: Any, sig: int) -> None:
    """Pass ``sig`` to the handler that was there before ours (the server's); without one,
    end the process as the signal would have."""
    if callable(handler):
        handler(sig, None)
    else:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)


@contextmanager
def _drain_on_sigterm(services: Services) -> Iterator[None]:
    """Make SIGTERM a gentle shutdown: new uploads and jobs get 503 at once, running jobs
    get ``BNRECAL_SHUTDOWN_GRACE_S`` to finish, then the server's own handler stops it
    (running jobs that are left go back to the queue). A second SIGTERM, or SIGINT, stops
    at once (SIGINT too refuses new work from then on). Only where signals can be handled
    (the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    server_handler = signal.getsignal(signal.SIGTERM)
    interrupt_handler = signal.getsignal(signal.SIGINT)

    def stop_server(sig: int) -> None:
        _hand_over(server_handler, sig)

    def drain_then_stop(sig: int) -> None:
        try:
            services.drain()
        finally:
            stop_server(sig)

    def on_sigterm(sig: int, frame: FrameType | None) -> None:
        if services.draining.is_set():
            stop_server(sig)
            return
        services.draining.set()  # before this handler returns: the next request already gets 503
        threading.Thread(target=drain_then_stop, args=(sig,), name="bnrecal-drain", daemon=True).start()

    def on_sigint(sig: int, frame: FrameType | None) -> None:
        services.draining.set()  # stopping at once: new work gets 503, and a Ray lost with it requeues its jobs
        _hand_over(interrupt_handler, sig)

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, server_handler)
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, interrupt_handler)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The application for ``settings`` (default: the environment's ``BNRECAL_*``).

    Besides the API it serves the web page (``/``, ``/jobs/{id}``) and its scripts and
    styles (``/static``). Its lifespan opens the ledger, recovers jobs a crash interrupted, joins Ray and
    starts the runner. SIGTERM drains: no new work (503), running jobs finish within
    ``BNRECAL_SHUTDOWN_GRACE_S``, the rest go back to the queue.
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # On the loop's thread on purpose: Ray wants to be started from the main thread.
        with _server_signal_handlers_kept():
            services = open_services(settings)
        app.state.services = services
        try:
            with _drain_on_sigterm(services):
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
