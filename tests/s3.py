"""A local S3-compatible server for the tests: moto's server mode on loopback, behind a
WSGI layer that records every request (method, key, Range header, bytes sent), so tests
can tell which bytes each run really fetched."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # moto, boto3 and werkzeug load with the server: a test session without S3 tests needs none
    from werkzeug.serving import BaseWSGIServer

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""Set in the test session's environment before Ray starts, so its workers inherit them:
no test can reach real AWS, and botocore signs requests without looking for a profile."""


@dataclass(frozen=True)
class Request:
    """One request the server answered."""

    method: str
    path: str  # /bucket/key
    range: str | None
    sent: int  # body bytes of the answer


@dataclass
class S3Server:
    """The running server: its endpoint, a client for it, and the requests it answered."""

    endpoint: str
    requests: list[Request] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> Any:
        """A boto3 S3 client on this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def bucket(self, name: str) -> str:
        """Create bucket ``name`` (if missing) and return it."""
        client = self.client()
        if name not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
            client.create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, key: str, body: bytes | Path) -> str:
        """Store an object and return its ``s3://`` URI."""
        data = body.read_bytes() if isinstance(body, Path) else body
        self.client().put_object(Bucket=self.bucket(bucket), Key=key, Body=data)
        return f"s3://{bucket}/{key}"

    def put_tree(self, bucket: str, prefix: str, folder: Path) -> str:
        """Store every file under ``folder`` at ``prefix/<relative path>``; return the prefix URI."""
        for file in sorted(folder.rglob("*")):
            if file.is_file():
                self.put(bucket, f"{prefix}/{file.relative_to(folder).as_posix()}", file)
        return f"s3://{bucket}/{prefix}"

    def gets(self, key: str) -> list[Request]:
        """The GET requests for ``/bucket/key`` answered so far."""
        with self._lock:
            return [r for r in self.requests if r.method == "GET" and r.path == key]

    def record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)


def _recording(app: Callable[..., Iterable[bytes]], server: S3Server) -> Callable[..., Iterable[bytes]]:
    """Wrap moto's WSGI app so each answer is recorded with the bytes of its body."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = b"".join(app(environ, start_response))
        server.record(Request(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("HTTP_RANGE"), len(body)))
        return [body]

    return wrapped


def start_s3_server() -> tuple[S3Server, BaseWSGIServer]:
    """Start moto's S3 on 127.0.0.1 and a free port, in a daemon thread."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class _QuietHandler(MotoRequestHandler):
        def log_request(self, *args: Any, **kwargs: Any) -> None:
            """Requests are recorded, not printed."""

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    state = S3Server(f"http://127.0.0.1:{port}")
    app = _recording(DomainDispatcherApplication(create_backend_app), state)
    httpd = make_server("127.0.0.1", port, app, threaded=True, request_handler=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="moto-s3", daemon=True).start()
    return state, httpd
