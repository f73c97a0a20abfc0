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
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from bnrecal.errors import TooManyStreamsError

from bnrecal.service.jobserver.records.record import JobRecord
from bnrecal.service.jobserver.records.views import JobStatus, JobView, Progress
from bnrecal.service.jobserver.ledger import Ledger
from bnrecal.service.jobserver.problems import Problem

KEEPALIVE_S = 15.0
DISCONNECT_CHECK_S = 1.0


MAX_TENANT_STREAMS = 8
"""Change streams (``GET /v1/jobs/events``) one tenant may hold open at once: a page open in
a few tabs needs one each; past it a new one is refused (429) rather than the server held."""


class TenantListener:
    """One open change stream of a tenant: the ids of jobs changed since it last looked."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.changed = asyncio.Event()
        self.pending: set[str] = set()
        self.removed: set[str] = set()


class ChangeFeed:
    """Wakes event streams (on any event loop) when a job changes (in any thread)."""

    def __init__(self, max_tenant_streams: int = MAX_TENANT_STREAMS) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._tenants: dict[str, set[TenantListener]] = {}
        self._max_tenant_streams = max_tenant_streams
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
            listeners = [listener for group in self._tenants.values() for listener in group]
        for job_id in job_ids:
            self.publish(job_id)
        for listener in listeners:
            _wake(listener.loop, listener.changed)

    def publish(self, job_id: str) -> None:
        """Tell the job's listeners it changed, and every tenant stream (each keeps only its
        tenant's jobs: it looks them up with its tenant); safe from any thread."""
        with self._lock:
            waiters = list(self._waiters.get(job_id, ()))
            listeners = [listener for group in self._tenants.values() for listener in group]
            for listener in listeners:
                listener.pending.add(job_id)
        for loop, changed in waiters:
            _wake(loop, changed)
        for listener in listeners:
            _wake(listener.loop, listener.changed)

    def publish_removed(self, tenant: str, job_id: str) -> None:
        """Tell the tenant's change streams that its job was deleted."""
        with self._lock:
            listeners = list(self._tenants.get(tenant, ()))
            for listener in listeners:
                listener.removed.add(job_id)
        for listener in listeners:
            _wake(listener.loop, listener.changed)

    def take(self, listener: TenantListener) -> tuple[set[str], set[str]]:
        """The ids changed and removed since the listener last took them (and clears its event)."""
        with self._lock:
            listener.changed.clear()
            changed, removed = listener.pending, listener.removed
            listener.pending, listener.removed = set(), set()
        return changed - removed, removed

    def open_tenant(self, tenant: str) -> TenantListener:
        """A listener told of every job change until :meth:`close_tenant` (call on the loop);
        ``TooManyStreamsError`` past ``MAX_TENANT_STREAMS`` open for the tenant."""
        listener = TenantListener(asyncio.get_running_loop())
        with self._lock:
            group = self._tenants.setdefault(tenant, set())
            if len(group) >= self._max_tenant_streams:
                raise TooManyStreamsError(
                    f"this API key already has {self._max_tenant_streams} change streams open, the most it may; "
                    "close a page or a client that follows its jobs, then retry"
                )
            group.add(listener)
        return listener

    def close_tenant(self, tenant: str, listener: TenantListener) -> None:
        """Stop telling the listener (its stream ended)."""
        with self._lock:
            group = self._tenants.get(tenant)
            if group is not None:
                group.discard(listener)
                if not group:
                    del self._tenants[tenant]

    def open_tenant_streams(self, tenant: str) -> int:
        """How many change streams the tenant holds open."""
        with self._lock:
            return len(self._tenants.get(tenant, ()))

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


def _wake(loop: asyncio.AbstractEventLoop, changed: asyncio.Event) -> None:
    try:
        loop.call_soon_threadsafe(changed.set)
    except RuntimeError:  # that loop has closed: its stream is gone
        pass


class JobEvent(BaseModel):
    """A ``status`` or ``progress`` event's data: the job's state as the ledger holds it."""

    model_config = ConfigDict(frozen=True)

    id: str
    status: JobStatus
    progress: Progress
    error: Problem | None


class CellState(BaseModel):
    """A sweep's finished cell as its ``cell`` event carries it: what the stored report says of
    it (None where the report lacks it) and the names of its artifacts."""

    model_config = ConfigDict(frozen=True, validate_by_name=True, serialize_by_alias=True)

    model: str | None
    model_index: int | None
    set_name: str | None = Field(alias="set")
    status: str | None
    error: str | None
    artifacts: list[str]


class CellEvent(BaseModel):
    """A ``cell`` event's data: the job, and the cell under ``cell`` (so a client that reads
    every event's ``status`` sees only the job's)."""

    model_config = ConfigDict(frozen=True)

    id: str
    cell: CellState


class ReadyEvent(BaseModel):
    """A tenant stream's first event: how many such streams a tenant may hold open."""

    model_config = ConfigDict(frozen=True)

    max_streams: int


class DeletedEvent(BaseModel):
    """A tenant stream's event for a job deleted through the API."""

    model_config = ConfigDict(frozen=True)

    id: str


def event_payload(job: JobRecord) -> JobEvent:
    """What one event says about the job."""
    return JobEvent(id=job.id, status=job.status, progress=job.progress(), error=job.error)


def cell_events(job: JobRecord) -> list[CellState]:
    """A sweep's finished cells, in the order they finished, as their ``cell`` events carry them:
    model, set, status, error and the names of its artifacts (none for a single job). The report
    is stored free-form JSON: a value of another type than the report writes reads as None."""
    cells = (job.report or {}).get("cells") if job.spec.get("models") is not None or job.spec.get("datasets") is not None \
        else None
    events = []
    for cell in cells if isinstance(cells, list) else []:
        model, set_name = _of(cell.get("model"), str), _of(cell.get("set"), str)
        key = f"{model}/{set_name}/"
        events.append(CellState(
            model=model, model_index=_of(cell.get("model_index"), int), set_name=set_name,
            status=_of(cell.get("status"), str), error=_of(cell.get("error"), str),
            artifacts=sorted(name for name in job.artifacts if name.startswith(key)),
        ))
    return events


_T = TypeVar("_T")


def _of(value: object, kind: type[_T]) -> _T | None:
    """``value`` when it is exactly a ``kind`` (a JSON ``true`` is no ``int``), else None."""
    return value if type(value) is kind else None


def format_event(event_id: int | None, kind: str, data: BaseModel) -> str:
    """One Server-Sent Event (without an ``id`` line when ``event_id`` is None): ``data`` as
    compact JSON, its fields in their declared order."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(data.model_dump(mode='json'), separators=(',', ':'))}\n\n"


async def job_event_stream(
    job_id: str,
    tenant: str,
    ledger: Ledger,
    feed: ChangeFeed,
    last_event_id: int | None,
    is_disconnected: Callable[[], Any],
) -> AsyncIterator[str]:
    """Events of one job from after ``last_event_id`` until (and including) its terminal status,
    or until the server shuts down (a client then resumes elsewhere with ``Last-Event-ID``).
    A sweep's stream also sends a ``cell`` event for each cell done (every one done so far
    when it opens, or resumes: a client keys them by model and set)."""
    sent = last_event_id if last_event_id is not None else 0
    last_status: str | None = None
    cells_sent = 0
    with feed.subscribe(job_id) as changed:
        while True:
            changed.clear()
            job = await run_in_threadpool(ledger.get, tenant, job_id)
            cells = cell_events(job)
            for cell in cells[cells_sent:]:  # a sweep's finished cells, each once per stream
                yield format_event(None, "cell", CellEvent(id=job.id, cell=cell))
            cells_sent = len(cells)
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


async def tenant_event_stream(
    tenant: str,
    listener: TenantListener,
    ledger: Ledger,
    feed: ChangeFeed,
    view: Callable[[JobRecord], JobView],
    is_disconnected: Callable[[], Any],
) -> AsyncIterator[str]:
    """Every change of the tenant's jobs, as it happens: first a ``ready`` event (a client
    lists the jobs after it, so nothing falls between its list and the stream), then a ``job``
    event with the job's resource (``view``) whenever one is created or changes, and a
    ``deleted`` event when one is deleted. Until the client goes or the server shuts down;
    the listener (opened by the caller, so a refusal is an HTTP error) is closed here."""
    try:
        yield format_event(None, "ready", ReadyEvent(max_streams=MAX_TENANT_STREAMS))
        quiet_since = time.monotonic()
        while not feed.closed:
            try:  # a closed connection is noticed within a second: it frees its place in the bound
                await asyncio.wait_for(listener.changed.wait(), timeout=DISCONNECT_CHECK_S)
            except TimeoutError:
                if await is_disconnected():
                    return
                if time.monotonic() - quiet_since >= KEEPALIVE_S:
                    quiet_since = time.monotonic()
                    yield ": keep-alive\n\n"
                continue
            quiet_since = time.monotonic()
            changed, removed = feed.take(listener)
            for job in await run_in_threadpool(ledger.get_many, tenant, changed):
                yield format_event(job.revision, "job", await run_in_threadpool(view, job))
            for job_id in sorted(removed):
                yield format_event(None, "deleted", DeletedEvent(id=job_id))
    finally:
        feed.close_tenant(tenant, listener)
