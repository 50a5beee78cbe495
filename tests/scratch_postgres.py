"""Throw-away PostgreSQL databases for tests and benchmarks (one piece of code for both).

The admin DSN comes from ``DP_BUDGET_TEST_PG`` (default: the local trust-auth server).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import sqlalchemy as sa

PG_ADMIN_DSN = os.environ.get(
    "DP_BUDGET_TEST_PG", "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
)


def dsn_part(name: str) -> str:
    """One field (host, port, user, ...) of the admin DSN."""
    return dict(item.split("=", 1) for item in PG_ADMIN_DSN.split()).get(name, "")


def url_of(database: str) -> str:
    """The SQLAlchemy URL of ``database`` on the admin DSN's server."""
    return (
        f"postgresql+psycopg2://{dsn_part('user')}@{dsn_part('host')}:{dsn_part('port')}/{database}"
    )


@functools.cache
def ledger_template() -> str:
    """The name of a database holding this package's newest ledger schema and nothing else
    (no configuration row: a ledger opened on a copy is created as on an empty database).

    Copying it (``CREATE DATABASE ... TEMPLATE``) is several times cheaper than running every
    migration for each test. It is made once per machine and schema: its name carries a
    digest of the migrations and the models, so a changed schema makes a new one (and the
    old ones are dropped); it is made under another name and renamed when complete, under
    an advisory lock, so concurrent test workers neither race nor see half of one.
    """
    from dp_budget_provider.ledger.storage import database  # the package under test

    package = Path(database.__file__).parent
    digest = hashlib.sha256()
    for path in sorted([package / "schema.py", *(package / "migrations").rglob("*.py")]):
        digest.update(path.read_bytes())
    name = f"dpb_template_{digest.hexdigest()[:16]}"
    admin = psycopg2.connect(PG_ADMIN_DSN, connect_timeout=5)
    admin.autocommit = True
    try:
        with admin.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(hashtext('dpb_template'))")
            cursor.execute("SELECT datname FROM pg_database WHERE datname LIKE 'dpb_template_%'")
            found = {row[0] for row in cursor.fetchall()}
            if name not in found:
                building = f"dpb_building_{uuid.uuid4().hex[:12]}"
                cursor.execute(f'CREATE DATABASE "{building}"')
                engine = database.make_engine(url_of(building))
                try:
                    with database.migrating(engine) as connection:
                        database.create_schema(connection)
                finally:
                    engine.dispose()
                cursor.execute(f'ALTER DATABASE "{building}" RENAME TO "{name}"')
                cursor.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
            for stale in found - {name}:
                with contextlib.suppress(psycopg2.Error):  # in use by a run of older code
                    cursor.execute(f'DROP DATABASE IF EXISTS "{stale}"')
            cursor.execute("SELECT pg_advisory_unlock(hashtext('dpb_template'))")
    finally:
        admin.close()
    return name


@contextlib.contextmanager
def scratch_database(prefix: str, create_options: str = "") -> Iterator[tuple[str, str]]:
    """A fresh database: yields (name, SQLAlchemy URL); terminated and dropped afterwards.

    Raises psycopg2.OperationalError when the server is unreachable (callers decide
    whether that is a test failure or a benchmark error: never a skip).
    """
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = psycopg2.connect(PG_ADMIN_DSN, connect_timeout=5)
    admin.autocommit = True
    try:
        with admin.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}" {create_options}')
        yield name, url_of(name)
    finally:
        with admin.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.close()


@contextlib.contextmanager
def source_engine(backend: str, folder: Path, prefix: str) -> Iterator[sa.Engine]:
    """An engine on a fresh source database of ``backend``: a SQLite file (in WAL mode, so
    a reader keeps its snapshot while another connection writes) in ``folder``, or a
    scratch PostgreSQL database; disposed (and dropped) afterwards."""
    if backend == "sqlite":
        engine = sa.create_engine(f"sqlite:///{folder / f'{prefix}.db'}")
        with engine.begin() as connection:
            connection.exec_driver_sql("PRAGMA journal_mode = WAL")
        try:
            yield engine
        finally:
            engine.dispose()
        return
    with scratch_database(prefix) as (_, url):
        engine = sa.create_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()
