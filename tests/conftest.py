"""Shared fixtures: real databases. PostgreSQL must be running; tests fail, not skip, without it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psycopg2
import pytest

from tests.ledger_time import ledger_time_in
from tests.scratch_postgres import ledger_template, scratch_database

# Airflow reads its configuration at import: give the whole test session a private,
# throw-away AIRFLOW_HOME before any test module imports airflow.
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="dp-budget-airflow-"))
os.environ["AIRFLOW_HOME"] = str(_AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(_AIRFLOW_HOME / "dags")
(_AIRFLOW_HOME / "dags").mkdir()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's AIRFLOW_HOME goes with the session (tmp_path folders are pytest's)."""
    shutil.rmtree(_AIRFLOW_HOME, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files marked ``heavy`` first, the rest in their order (a stable sort): xdist
    hands out whole files (``--dist loadfile``) in this order, so the long ones start early
    and the short ones fill the workers' last minutes, instead of one worker finishing a
    long file alone."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(scope="module", autouse=True)
def ledger_windows(request: pytest.FixtureRequest) -> Iterator[None]:
    """The ledger's clock, in this process, inside the windows the module's
    ``LEDGER_WINDOWS`` names (for the whole module: its fixtures charge them too); the
    real clock for a module without it (see ``tests/ledger_time.py``)."""
    windows = getattr(request.module, "LEDGER_WINDOWS", ())
    if not windows:
        yield
        return
    with pytest.MonkeyPatch.context() as monkeypatch:
        ledger_time_in(monkeypatch, *windows)
        yield


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, holding the newest ledger schema and no
    ledger (a copy of ``ledger_template()``: what creating the schema makes, made once),
    dropped afterwards."""
    yield from _scratch_postgres(f'TEMPLATE "{_template()}"')


@pytest.fixture
def blank_postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test (no schema), dropped afterwards."""
    yield from _scratch_postgres("")


def _template() -> str:
    try:
        return ledger_template()
    except psycopg2.OperationalError as error:
        pytest.fail(f"PostgreSQL is required for the tests and is not reachable: {error}")


def _scratch_postgres(options: str) -> Iterator[str]:
    try:
        with scratch_database("dpb_test", options) as (_, url):
            yield url
    except psycopg2.OperationalError as error:
        pytest.fail(f"PostgreSQL is required for the tests and is not reachable: {error}")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    """A fresh embedded (file) ledger database."""
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request) -> str:
    """Each test using this runs once on SQLite (file) and once on PostgreSQL."""
    fixture = {"sqlite": "sqlite_url", "postgresql": "postgres_url"}[request.param]
    return request.getfixturevalue(fixture)


@pytest.fixture(params=["sqlite", "postgresql"])
def blank_ledger_url(request) -> str:
    """``ledger_url`` on databases with no schema at all (a migration's starting point)."""
    fixture = {"sqlite": "sqlite_url", "postgresql": "blank_postgres_url"}[request.param]
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


@pytest.fixture
def exact_answers(monkeypatch) -> list[list]:
    """The exact answer of every release (as a list), as its noise is added to it: what
    the noise hides, for tests that check what a release computed."""
    from dp_budget_provider.accounting.release import NoisePlan  # numpy only, no Airflow

    seen: list[list] = []
    noisy_array = NoisePlan.noisy_array

    def spy(plan, answer, **kwargs):
        seen.append(np.asarray(answer).tolist())
        return noisy_array(plan, answer, **kwargs)

    monkeypatch.setattr(NoisePlan, "noisy_array", spy)
    return seen
