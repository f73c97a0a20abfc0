"""Job events: change notifications from the runner threads, and the Server-Sent Event stream.

Each event carries the job's status and progress as the ledger holds them, with the
job's ``revision`` as the event id. Ids therefore increase, and a client resuming with
``Last-Event-ID`` gets the current state if anything changed since that id (progress
is cumulative, so the latest event says everything the missed ones did). The stream
ends after the event of a terminal status.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from starlette.concurrency import run_in_threadpool

from .jobs import JobRecord
from .ledger import Ledger

KEEPALIVE_S = 15.0


class ChangeFeed:
    """Wakes event streams (on any event loop) when a job changes (in any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether the server is shutting down: streams end after their next event."""
        return self._closed

    def close(self) -> None:
        """End every stream (after it has sent the job's current state), so a shutting-down
        server is not held open by clients following jobs that will not finish here."""
        with self._lock:
            self._closed = True
            job_ids = list(self._waiters)
        for job_id in job_ids:
            self.publish(job_id)

    def publish(self, job_id: str) -> None:
        """Tell the job's listeners it changed; safe from any thread."""
        with self._lock:
            waiters = list(self._waiters.get(job_id, ()))
        for loop, changed in waiters:
            try:
                loop.call_soon_threadsafe(changed.set)
            except RuntimeError:  # that loop has closed: its stream is gone
                pass

    @contextmanager
    def subscribe(self, job_id: str) -> Iterator[asyncio.Event]:
        """An event set whenever the job changes, while the context is open (call on the loop)."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.setdefault(job_id, set()).add(entry)
        try:
            yield entry[1]
        finally:
            with self._lock:
                listeners = self._waiters.get(job_id)
                if listeners is not None:
                    listeners.discard(entry)
                    if not listeners:
                        del self._waiters[job_id]


def event_payload(job: JobRecord) -> dict[str, Any]:
    """What one event says about the job."""
    return {
        "id": job.id,
        "status": job.status.value,
        "progress": job.progress().model_dump(),
        "error": job.error,
    }


def format_event(event_id: int, kind: str, data: dict[str, Any]) -> str:
    """One Server-Sent Event."""
    return f"id: {event_id}\nevent: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def job_event_stream(
    job_id: str,
    tenant: str,
    ledger: Ledger,
    feed: ChangeFeed,
    last_event_id: int | None,
    is_disconnected: Callable[[], Any],
) -> AsyncIterator[str]:
    """Events of one job from after ``last_event_id`` until (and including) its terminal status,
    or until the server shuts down (a client then resumes elsewhere with ``Last-Event-ID``)."""
    sent = last_event_id if last_event_id is not None else 0
    last_status: str | None = None
    with feed.subscribe(job_id) as changed:
        while True:
            changed.clear()
            job = await run_in_threadpool(ledger.get, tenant, job_id)
            if job.revision > sent:
                kind = "progress" if last_status == job.status.value else "status"
                yield format_event(job.revision, kind, event_payload(job))
                sent, last_status = job.revision, job.status.value
            if job.status.is_terminal or feed.closed:
                return
            try:
                await asyncio.wait_for(changed.wait(), timeout=KEEPALIVE_S)
            except TimeoutError:
                if await is_disconnected():
                    return
                yield ": keep-alive\n\n"
