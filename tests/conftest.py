"""Shared fixtures: real databases. PostgreSQL must be running; tests fail, not skip, without it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest

# Airflow reads its configuration at import: give the whole test session a private,
# throw-away AIRFLOW_HOME before any test module imports airflow.
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="dp-budget-airflow-"))
os.environ["AIRFLOW_HOME"] = str(_AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(_AIRFLOW_HOME / "dags")
(_AIRFLOW_HOME / "dags").mkdir()

PG_ADMIN_DSN = os.environ.get(
    "DP_BUDGET_TEST_PG", "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
)


def _admin() -> psycopg2.extensions.connection:
    try:
        connection = psycopg2.connect(PG_ADMIN_DSN, connect_timeout=5)
    except psycopg2.OperationalError as error:
        pytest.fail(f"PostgreSQL is required for the tests and is not reachable: {error}")
    connection.autocommit = True
    return connection


def _dsn_part(name: str) -> str:
    parts = dict(item.split("=", 1) for item in PG_ADMIN_DSN.split())
    return parts.get(name, "")


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    name = f"dpb_test_{uuid.uuid4().hex[:12]}"
    admin = _admin()
    with admin.cursor() as cursor:
        cursor.execute(f'CREATE DATABASE "{name}"')
    try:
        yield (
            f"postgresql+psycopg2://{_dsn_part('user')}@{_dsn_part('host')}:"
            f"{_dsn_part('port')}/{name}"
        )
    finally:
        with admin.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.close()


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    """A fresh embedded (file) ledger database."""
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request) -> str:
    """Each test using this runs once on SQLite (file) and once on PostgreSQL."""
    fixture = {"sqlite": "sqlite_url", "postgresql": "postgres_url"}[request.param]
    return request.getfixturevalue(fixture)


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """A migrated Airflow metadata database (SQLite) under the session's AIRFLOW_HOME."""
    airflow = Path(sys.executable).with_name("airflow")
    result = subprocess.run(
        [str(airflow), "db", "migrate"], capture_output=True, text=True, env=os.environ, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"airflow db migrate failed:\n{result.stdout}\n{result.stderr}")
    return _AIRFLOW_HOME
