"""A small Python client of the bnrecal HTTP API (``bnrecal submit`` is built on it).

Errors come back as the same typed errors the server raised (a problem's ``type``
names its class), so a caller handles a remote bad checkpoint exactly like a local one.

    with BnrecalClient("http://127.0.0.1:8000", api_key="...") as client:
        checkpoint = client.upload("model.safetensors").digest
        data = client.upload("calib.npy").digest
        job = client.submit({"arch": "torchvision:resnet18", "checkpoint": checkpoint, "data": data})
        job = client.wait(job.id, on_progress=lambda done, total, phase: print(phase, done, total))
        client.download(job.id, "checkpoint", "recalibrated.safetensors")
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import httpx
from pydantic import ValidationError

from bnrecal.errors import (
    AuthenticationError,
    BnrecalError,
    CancelledError,
    HeadersTooLargeError,
    InputError,
    NotFoundError,
    PayloadTooLargeError,
    RunError,
    ServiceUnavailableError,
    SpecError,
    TooManyJobsError,
)
from bnrecal.workers.files import atomic_write, file_digest

from .jobserver.records.views import JobList, JobView
from .jobserver.storage.blobs import MAX_FILENAME_CHARS, BlobInfo  # the longest file name the server keeps
from .jobserver.problems import Problem, error_classes, http_status

if TYPE_CHECKING:
    from .jobserver.records.spec import JobSpec  # the typed spec the CLI and the Python API build

TERMINAL = ("succeeded", "failed", "cancelled")
COUNTED_PHASES = ("calibrating", "evaluating")
"""The phases whose events count samples; the others (starting workers, exporting, writing) count nothing."""
UPLOAD_CHUNK = 1024 * 1024
STREAM_RESUME_S = 0.5
"""Pause before resuming an event stream the server ended before the job did (it was shutting down)."""


@dataclass(frozen=True)
class ServerEvent:
    """One Server-Sent Event of a job."""

    id: int | None
    kind: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Downloaded:
    """An artifact saved from the server: where, its digest (checked against the server's) and size."""

    path: Path
    digest: str
    size: int


_BY_STATUS: dict[int, type[BnrecalError]] = {
    http_status(cls): cls
    for cls in (
        AuthenticationError, NotFoundError, PayloadTooLargeError,
        TooManyJobsError, HeadersTooLargeError, ServiceUnavailableError,
    )
}
"""The statuses that name one error class: how an answer without a body (to ``HEAD``) is typed."""


def error_from_problem(problem: Problem) -> BnrecalError:
    """The typed error a problem stands for (by its ``type``; else by its status)."""
    cls = error_classes().get(problem.type) or _BY_STATUS.get(problem.status)
    if cls is None:
        cls = InputError if 400 <= problem.status < 500 else RunError
    error = cls(problem.detail or problem.title or "unknown error")
    if isinstance(error, SpecError):
        error.field = problem.field
    return error


def problem_in(body: object, status: int, reason: str) -> Problem:
    """The problem an error answer holds; for a body that is not one (a proxy's page, a
    ``HEAD`` answer without a body), one made of the status and what the body said."""
    if isinstance(body, dict):
        try:
            return Problem.model_validate({"type": "about:blank", "title": reason, "status": status, **body})
        except ValidationError:
            pass
    return Problem(type="about:blank", title=reason, status=status, detail=f"HTTP {status}: {str(body)[:200] or reason}")


class BnrecalClient:
    """Uploads, jobs, events and downloads against one bnrecal server."""

    def __init__(self, server: str, api_key: str | None = None, *, timeout: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.server = server.rstrip("/")
        self._http = httpx.Client(
            base_url=self.server, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0)
        )

    def __enter__(self) -> BnrecalClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    def upload(
        self,
        path: str | os.PathLike[str],
        on_bytes: Callable[[int, int], None] | None = None,
        filename: str | None = None,
    ) -> BlobInfo:
        """Upload a file (streamed, never read whole) or a folder (sent as a tar); the stored
        blob (digest, size and the file name the server keeps).

        The server is told the file's name (a folder's name for a folder), or ``filename``,
        so the errors of a job that uses the blob name it rather than its digest.
        """
        source = Path(path)
        if source.is_dir():
            with _tarred(source) as archive:
                return self.upload(archive, on_bytes, filename or source.absolute().resolve().name)
        try:
            size = source.stat().st_size
            stream = source.open("rb")
        except OSError as exc:
            raise InputError(f"cannot read {source}: {exc.strerror or exc}") from exc
        with stream:
            def chunks() -> Iterator[bytes]:
                sent = 0
                while block := stream.read(UPLOAD_CHUNK):
                    sent += len(block)
                    if on_bytes is not None:
                        on_bytes(sent, size)
                    yield block

            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
            params = {"filename": (filename or source.name)[:MAX_FILENAME_CHARS]}
            return BlobInfo(**self._json("POST", "/v1/blobs", content=chunks(), headers=headers, params=params))

    def has_blob(self, digest: str) -> bool:
        """Whether this key already has the blob (``HEAD /v1/blobs/{digest}``), so it need not be sent again."""
        try:
            response = self._http.head(f"/v1/blobs/{digest}")
        except httpx.TransportError as exc:
            raise RunError(f"cannot reach the bnrecal server at {self.server}: {exc}") from exc
        if response.status_code == 404:
            return False
        if response.is_error:
            raise self._error(response)
        return True

    def upload_missing(
        self,
        path: str | os.PathLike[str],
        on_bytes: Callable[[int, int], None] | None = None,
        filename: str | None = None,
    ) -> tuple[str, int]:
        """A file's (or folder's) blob digest, uploading it only when the server lacks it;
        returns the digest and the bytes sent (0 when the server had it)."""
        source = Path(path)
        with prepared_upload(source) as file:
            digest = upload_digest(file)
            if self.has_blob(digest):
                return digest, 0
            name = filename or (source.absolute().resolve().name if source.is_dir() else None)
            blob = self.upload(file, on_bytes, name)
            return blob.digest, blob.size

    def check(self, spec: JobSpec | Mapping[str, Any]) -> dict[str, Any]:
        """Check a job spec (a ``JobSpec``, or its JSON) as completely as a submission would,
        creating nothing (``POST /v1/jobs?dry_run=true``): the spec as it would be stored, or
        the typed error."""
        return self._json("POST", "/v1/jobs", params={"dry_run": "true"}, json=spec_json(spec))["spec"]

    def upload_bytes(self, data: bytes) -> BlobInfo:
        """Upload bytes held in memory (small blobs)."""
        return BlobInfo(**self._json("POST", "/v1/blobs", content=data, headers={"Content-Type": "application/octet-stream"}))

    def submit(self, spec: JobSpec | Mapping[str, Any], idempotency_key: str | None = None) -> JobView:
        """Submit a job spec (a ``JobSpec``, or its JSON: the server validates it either way);
        the same ``idempotency_key`` on a retry returns the same job."""
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        return JobView.model_validate(self._json("POST", "/v1/jobs", json=spec_json(spec), headers=headers))

    def job(self, job_id: str) -> JobView:
        """The job resource."""
        return JobView.model_validate(self._json("GET", f"/v1/jobs/{job_id}"))

    def jobs(self, status: str | None = None, limit: int = 50) -> list[JobView]:
        """This key's jobs, newest first."""
        params: dict[str, Any] = {"limit": limit} | ({"status": status} if status else {})
        return JobList.model_validate(self._json("GET", "/v1/jobs", params=params)).jobs

    def cancel(self, job_id: str) -> JobView:
        """Ask the server to cancel a job."""
        return JobView.model_validate(self._json("POST", f"/v1/jobs/{job_id}/cancel"))

    def delete_job(self, job_id: str) -> None:
        """Delete a finished job and its artifacts (a queued or running one is a ``ConflictError``)."""
        self._json("DELETE", f"/v1/jobs/{job_id}")

    def delete_blob(self, digest: str) -> None:
        """Delete a blob (a ``ConflictError`` while a queued or running job uses it)."""
        self._json("DELETE", f"/v1/blobs/{digest}")

    def events(self, job_id: str, last_event_id: int | None = None) -> Iterator[ServerEvent]:
        """The job's events from after ``last_event_id``, until the server ends the stream."""
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        with self._http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
            if response.is_error:
                response.read()
                raise self._error(response)
            yield from parse_events(response.iter_lines())

    def wait(
        self, job_id: str, on_progress: Callable[[int, int | None, str], None] | None = None, *, reconnects: int = 5
    ) -> JobView:
        """Follow a job's events to its end (resuming a dropped stream) and return the final job.

        ``on_progress`` gets (samples done, samples total, phase) for each event of a phase
        that counts samples (calibrating, evaluating), and (0, None, phase) once when the job
        enters a phase that counts nothing (starting workers, exporting, writing).
        """
        last_id: int | None = None
        failures = 0
        shown: str | None = None
        while True:
            try:
                for event in self.events(job_id, last_id):
                    last_id = event.id if event.id is not None else last_id
                    progress = event.data.get("progress") or {}
                    phase = progress.get("phase")
                    if on_progress is not None and phase:
                        if phase in COUNTED_PHASES and progress.get("samples_total"):
                            on_progress(int(progress["samples_done"]), int(progress["samples_total"]), phase)
                        elif phase != shown and phase not in COUNTED_PHASES:
                            on_progress(0, None, str(phase))
                        shown = phase
                    if event.data.get("status") in TERMINAL:
                        return self.job(job_id)
                job = self.job(job_id)
                if job.status.is_terminal:
                    return job
                failures = 0
                time.sleep(STREAM_RESUME_S)  # the server ended the stream early (shutting down?)
            except httpx.TransportError as exc:
                failures += 1
                if failures > reconnects:
                    raise RunError(f"lost the event stream of job {job_id} from {self.server}: {exc}") from exc
                time.sleep(min(2.0**failures * 0.25, 5.0))

    def download(self, job_id: str, name: str, path: str | os.PathLike[str]) -> Downloaded:
        """Save an artifact (``checkpoint``, ``onnx``, ``report``) atomically, checking its digest."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()

        def fetch(temp: Path) -> None:
            url = f"/v1/jobs/{job_id}/artifacts/{name}"
            try:
                with temp.open("wb") as out, self._http.stream("GET", url) as response:
                    if response.is_error:
                        response.read()
                        raise self._error(response)
                    for block in response.iter_bytes(UPLOAD_CHUNK):
                        digest.update(block)
                        out.write(block)
                    expected = response.headers.get("etag", "").strip('"')
            except httpx.TransportError as exc:  # the server cuts off a download whose bytes fail their digest
                raise RunError(
                    f"download of {name} of job {job_id} was cut off ({type(exc).__name__}): the connection broke, "
                    "or the server found its stored copy damaged (it then answers 404 and the job must be run again); "
                    "nothing was written"
                ) from exc
            received = f"sha256:{digest.hexdigest()}"
            if expected and expected != received:
                raise RunError(f"download of {name} of job {job_id} is corrupt: got {received}, expected {expected}")

        atomic_write(target, fetch)  # the usual file mode; nothing at the target unless the digest matched
        return Downloaded(target, f"sha256:{digest.hexdigest()}", target.stat().st_size)

    def _json(self, method: str, url: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise RunError(f"cannot reach the bnrecal server at {self.server}: {exc}") from exc
        if response.is_error:
            raise self._error(response)
        return response.json() if response.content else None

    def _error(self, response: httpx.Response) -> BnrecalError:
        try:
            body: object = response.json()
        except ValueError:
            body = response.text  # a HEAD answer has none
        return error_from_problem(problem_in(body, response.status_code, response.reason_phrase))


def parse_events(lines: Iterator[str]) -> Iterator[ServerEvent]:
    """Server-Sent Events from the lines of a ``text/event-stream``."""
    event_id: int | None = None
    kind = "message"
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield ServerEvent(event_id, kind, json.loads("\n".join(data)))
            kind, data = "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id" and value.isdigit():
            event_id = int(value)
        elif name == "event":
            kind = value
        elif name == "data":
            data.append(value)


ProgressUpdate = Callable[[int, int | None, str], None]
"""A progress display's ``update(done, total, phase)``."""
BLOB_FIELDS = ("checkpoint", "program", "data", "eval.data")
"""The spec fields that name an uploaded file by its digest."""


def spec_json(spec: JobSpec | Mapping[str, Any]) -> dict[str, Any]:
    """A job spec as sent: a ``JobSpec``'s fields as they were given (the server fills in every
    default, as it stores the spec), JSON as it is."""
    if isinstance(spec, Mapping):
        return dict(spec)
    return spec.model_dump(mode="json", exclude_unset=True)


def input_digests(inputs: Mapping[str, Path | str]) -> dict[str, Any]:
    """The inputs of a job spec by field (``checkpoint``, ``data``, ``eval.data``,
    ``models[0].program``, ``datasets.<name>.data``...), named as the spec names them: a local
    file or folder by the digest of what uploading it sends (hashed here, nothing sent), a URI
    as ``{"uri": ...}`` for the server to read."""
    named: dict[str, Any] = {}
    for name, source in inputs.items():
        if isinstance(source, Path):
            with prepared_upload(source) as prepared:
                named[name] = upload_digest(prepared)
        else:
            named[name] = {"uri": source}  # object storage: the server reads it
    return named


def run_remote_job(
    client: BnrecalClient,
    spec: JobSpec,
    inputs: Mapping[str, Path | str],
    *,
    follow: Callable[[str], AbstractContextManager[ProgressUpdate]],
    downloads: Callable[[JobView], Sequence[tuple[str, Path]]] = lambda job: (),
    on_submitted: Callable[[JobView], None] | None = None,
    on_interrupt: Callable[[str], NoReturn] | None = None,
    keep_failed: bool = False,
) -> JobView:
    """One job on the server from local files, for ``bnrecal submit``, ``bnrecal sweep
    --server`` and ``bnrecal.recalibrate(server=...)`` alike; the finished job.

    ``spec`` is the typed job spec, its inputs named (:func:`input_digests`); ``inputs`` are
    the same fields' sources: a local file or folder, uploaded if the server lacks it, or a
    URI the server reads. The spec is checked on the server before any byte is sent
    (``dry_run``), so bad input fails at once; then only the files the server lacks are
    uploaded (``follow`` shows each upload's bytes), the job is submitted and followed to its
    end (``follow("queued")``, ``on_submitted`` first), and a failed or cancelled job raises
    the error it ended with. ``downloads`` says which artifacts of the succeeded job to save
    where (``downloading``); with ``keep_failed`` a failed job that left artifacts (a sweep
    some of whose cells failed) is downloaded and returned too. Ctrl-C while it runs goes to
    ``on_interrupt`` with the job's id, else it propagates."""
    if not _passes_dry_run(client, spec):
        named = spec.input_sources()
        for name, source in inputs.items():
            if isinstance(source, Path) and not client.has_blob(named[name]):
                label = f"uploading {source.name}"
                with follow(label) as update:
                    blob = client.upload(source, on_bytes=lambda sent, total: update(sent, total, label))
                if blob.digest != named[name]:  # the bytes sent are not the bytes the spec names
                    raise InputError(f"{name}: {source} changed while it was being sent; run again")
    job = client.submit(spec, idempotency_key=uuid.uuid4().hex)
    with follow("queued") as update:
        try:  # from the moment the job exists, Ctrl-C is about it: even while its id is being shown
            if on_submitted is not None:
                on_submitted(job)
            job = client.wait(job.id, on_progress=update)
        except KeyboardInterrupt:
            if on_interrupt is None:
                raise
            on_interrupt(job.id)
        if not (keep_failed and job.status == "failed" and job.artifacts):
            _raise_unless_succeeded(job, client.server)
        wanted = list(downloads(job))
        for done, (name, path) in enumerate(wanted):
            update(done, len(wanted), "downloading")
            client.download(job.id, name, path)
        if wanted:
            update(len(wanted), len(wanted), "downloading")
    return job


_SWEEP_FIELD = re.compile(r"^(?:models\[(\d+)\]\.(checkpoint|program)|datasets\.(.+)\.(data|eval\.data))$")
"""A sweep's input fields: ``models[3].checkpoint``, ``datasets.<name>.data`` (a name may hold dots)."""


def is_blob_field(name: str | None) -> bool:
    """Whether a spec field names an uploaded file by its digest (a single job's or a sweep's)."""
    return name is not None and (name in BLOB_FIELDS or _SWEEP_FIELD.match(name) is not None)


def _passes_dry_run(client: BnrecalClient, spec: JobSpec) -> bool:
    """Check the spec on the server before any byte of a file is sent (``dry_run=true``),
    naming the files by the digests computed here: True when it passed whole (the server has
    every file). The only refusal an upload fixes is a file the server does not have yet
    (False: ``HEAD`` then tells which); any other is the caller's error."""
    try:
        client.check(spec)
    except SpecError as exc:
        if not is_blob_field(exc.field):
            raise
        return False
    return True


def _raise_unless_succeeded(job: JobView, server: str) -> None:
    """Turn a failed or cancelled job into the error it ended with."""
    if job.status == "succeeded":
        return
    if job.status == "cancelled":
        raise CancelledError(f"job {job.id} on {server} was cancelled")
    raise error_from_problem(job.error or Problem(type="about:blank", title="Failed", status=500,
                                                  detail=f"job {job.id} {job.status.value}"))


def upload_digest(path: str | os.PathLike[str]) -> str:
    """The digest the server names the blob of a local file's bytes by (streamed); a file that
    cannot be read is the caller's ``InputError``."""
    try:
        return file_digest(path)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from exc


@contextmanager
def prepared_upload(source: Path) -> Iterator[Path]:
    """The file whose bytes an upload of ``source`` sends: the file itself, or a folder's tar."""
    if source.is_dir():
        with _tarred(source) as archive:
            yield archive
    else:
        yield source


@contextmanager
def _tarred(folder: Path) -> Iterator[Path]:
    """A temporary uncompressed tar of a folder's files, in sorted order, without links.

    Its bytes depend only on the files' names, contents and modes (times and owners are
    left out), so the same folder tars to the same digest and is not uploaded twice.
    """
    fd, name = tempfile.mkstemp(prefix="bnrecal-upload-", suffix=".tar")
    os.close(fd)
    archive = Path(name)

    def plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        return info

    try:
        with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
            for file in sorted(folder.rglob("*")):
                if file.is_file() and not file.is_symlink():
                    tar.add(file, arcname=str(file.relative_to(folder)), recursive=False, filter=plain)
        yield archive
    finally:
        archive.unlink(missing_ok=True)
