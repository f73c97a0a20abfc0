"""A throwaway PostgreSQL server for the tests: Debian's ``postgresql`` binaries (the
Makefile's ``test`` target installs them), a fresh cluster under a temporary folder,
listening on a free loopback port and a unix socket in that folder, stopped at the end.

PostgreSQL refuses to run as root, so as root the cluster belongs to the ``postgres``
user and its commands run through ``runuser``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


@dataclass(frozen=True)
class PostgresServer:
    """A running cluster: its port and a way to make empty databases on it."""

    port: int
    user: str

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL (psycopg 3) of ``database`` on this server."""
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:16]
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={self.user} dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def execute(self, url: str, sql: str) -> None:
        """Run one statement on the database of ``url`` (a test reaching under the ledger)."""
        import psycopg

        dbname = url.rsplit("/", 1)[-1]
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={self.user} dbname={dbname}", autocommit=True) as c:
            c.execute(sql)


def _bin(name: str) -> str:
    for folder in BIN_DIRS:
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"PostgreSQL's {name} is not installed: run `make test` (it installs `postgresql`)")
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """Start a fresh cluster (trust auth, loopback only), yield it, stop it and remove its files."""
    as_root = os.geteuid() == 0
    owner = "postgres" if as_root else pwd.getpwuid(os.geteuid()).pw_name
    root = Path(tempfile.mkdtemp(prefix="bnrecal-pg-"))
    data, log = root / "data", root / "server.log"
    if as_root:
        entry = pwd.getpwnam(owner)
        os.chown(root, entry.pw_uid, entry.pw_gid)
        root.chmod(0o700)
    prefix = ["runuser", "-u", owner, "--"] if as_root else []

    def run(*argv: str) -> None:
        subprocess.run([*prefix, *argv], check=True, capture_output=True, cwd=root)

    port = _free_port()
    try:
        run(_bin("initdb"), "-D", str(data), "-U", owner, "-A", "trust", "--no-sync", "-E", "UTF8")
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off -c max_connections=200"
        run(_bin("pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start")
        try:
            yield PostgresServer(port=port, user=owner)
        finally:
            run(_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
    except subprocess.CalledProcessError as error:
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(f"PostgreSQL failed: {error.stderr.decode(errors='replace')}\n{tail}") from error
    finally:
        shutil.rmtree(root, ignore_errors=True)
