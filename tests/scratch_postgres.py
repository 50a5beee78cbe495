"""Throw-away PostgreSQL databases for tests and benchmarks (one piece of code for both).

The admin DSN comes from ``DP_BUDGET_TEST_PG`` (default: the local trust-auth server).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import psycopg2

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
