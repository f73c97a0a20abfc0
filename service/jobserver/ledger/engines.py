"""The ledger's two databases behind one interface: SQLite (the embedded default, one
process) and PostgreSQL (shared by the replicas of a replicated service).

What differs between them lives here and only here: how an engine is made, how the schema
is created and upgraded in place when several processes open the ledger at once, and how a
transaction serialises with others of the same tenant (SQLite's writers already take
turns; Postgres takes a transaction-scoped advisory lock).
"""

from __future__ import annotations

import sqlite3
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, MetaData, Table, create_engine, event, inspect, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.orm import Session

from bnrecal.errors import SpecError

SCHEMA_LOCK = 0x626E7263  # "bnrc": the advisory lock held while one process creates or upgrades the schema
POSTGRES_DRIVER = "postgresql+psycopg"
SQLITE_BUSY_S = 30  # how long a SQLite connection waits for another writer before giving up


def normalise_url(url: str) -> str:
    """The SQLAlchemy URL to open: a bare ``postgres://`` or ``postgresql://`` URL means psycopg 3
    (the driver the ``postgres`` extra installs); anything but SQLite and Postgres is refused."""
    for bare in ("postgres://", "postgresql://"):
        if url.startswith(bare):
            url = POSTGRES_DRIVER + "://" + url[len(bare):]
    try:
        parsed = make_url(url)
    except ArgumentError as error:
        raise SpecError(f"BNRECAL_DATABASE_URL is not a database URL: {error}") from None
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise SpecError(
            f"BNRECAL_DATABASE_URL names a {parsed.get_backend_name()!r} database; the ledger runs on SQLite "
            "(sqlite:///path) or PostgreSQL (postgresql+psycopg://user:password@host/db)"
        )
    if parsed.get_backend_name() == "postgresql" and parsed.drivername != POSTGRES_DRIVER:
        raise SpecError(f"BNRECAL_DATABASE_URL: use the psycopg 3 driver, {POSTGRES_DRIVER}://...")
    return url


def is_postgres(engine: Engine) -> bool:
    """Whether the ledger is a shared Postgres database (rather than an embedded SQLite file)."""
    return engine.dialect.name == "postgresql"


def make_engine(url: str) -> Engine:
    """An engine; for SQLite: WAL journal, a busy timeout, and connections usable from any thread;
    for Postgres: a pool that checks a connection before using it."""
    url = normalise_url(url)
    if url.startswith("postgresql"):
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise SpecError(
                "BNRECAL_DATABASE_URL is a PostgreSQL URL but psycopg is not installed: pip install 'bnrecal[postgres]'"
            ) from None
        return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)
    database = url.split("///", 1)[-1]
    if database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_S})

    @event.listens_for(engine, "connect")
    def _configure(connection: Any, _record: Any) -> None:
        cursor = connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_S * 1000}")
        _use_wal(cursor)
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return engine


def _use_wal(cursor: Any) -> None:
    """Switch a new database file to the WAL journal. The switch needs the file to itself and
    SQLite answers "database is locked" at once, without waiting out the busy timeout, while
    another process or thread opening the same new file holds it: so take turns here, within
    the busy timeout, and leave a file that is already WAL alone."""
    deadline = time.monotonic() + SQLITE_BUSY_S
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def prepare_schema(engine: Engine, metadata: MetaData) -> None:
    """Create the tables, and add the nullable columns a newer release declares to tables an
    older one created (so upgrading keeps every stored job). On Postgres this runs under an
    advisory lock, so replicas starting together do not race to create the same table; on
    SQLite a process that lost that race finds the table made and tries once more."""
    for attempt in range(3):
        try:
            with engine.begin() as connection:
                if is_postgres(engine):
                    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK})
                metadata.create_all(connection)
                for table in metadata.sorted_tables:
                    _add_missing_columns(connection, table)
            return
        except OperationalError as error:
            if is_postgres(engine) or "already exists" not in str(error) or attempt == 2:
                raise


def _add_missing_columns(connection: Connection, table: Table) -> None:
    present = {column["name"] for column in inspect(connection).get_columns(table.name)}
    for column in table.columns:
        if column.name not in present and column.nullable:
            kind = column.type.compile(dialect=connection.dialect)
            connection.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}"))


def lock_tenant(session: Session, tenant: str) -> None:
    """Serialise this transaction with every other one of ``tenant`` that also takes the lock
    (until it ends), so that a count checked after an insert is exact. SQLite needs nothing:
    its writers already take turns."""
    if session.get_bind().dialect.name == "postgresql":
        key = zlib.crc32(tenant.encode()) - 2**31  # a signed 32-bit key of its own per tenant
        session.execute(text("SELECT pg_advisory_xact_lock(:space, :key)"), {"space": SCHEMA_LOCK, "key": key})


@contextmanager
def exclusive_turn(engine: Engine, name: str) -> Iterator[bool]:
    """Whether this process may do ``name``'s periodic work now, held until the context ends:
    on Postgres a session advisory lock that only one replica gets at a time (the others are
    told False and skip their turn; a replica that dies lets go with its connection); on
    SQLite, one process, always True."""
    if not is_postgres(engine):
        yield True
        return
    key = zlib.crc32(name.encode()) - 2**31
    with engine.connect() as connection:
        got = bool(connection.execute(text("SELECT pg_try_advisory_lock(:space, :key)"),
                                      {"space": SCHEMA_LOCK, "key": key}).scalar())
        connection.commit()
        try:
            yield got
        finally:
            if got:
                connection.execute(text("SELECT pg_advisory_unlock(:space, :key)"), {"space": SCHEMA_LOCK, "key": key})
                connection.commit()
