"""example_dp_visits_heatmap as shipped, run with dag.test() against a visits table in a
scratch PostgreSQL database (connection ``visits_db`` of type postgres, the docstring's
set-up), ledger on SQLite and PostgreSQL: the heatmap has the grid's 16 cells, near the
bounded counts, and exactly the persons of the bounded rows are charged."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa

from dp_budget_provider.ledger import key_for
from tests.airflow.dag_runner import load_dag, stored_xcom, task_states
from tests.operators.conftest import ledger  # noqa: F401 - the operator tests' ledger fixture
from tests.scratch_postgres import scratch_database

pytestmark = pytest.mark.heavy

DAG_FILE = Path(__file__).resolve().parents[2] / "dags" / "example_dp_visits_heatmap.py"
WINDOW = "2026-w28"
LEDGER_WINDOWS = (WINDOW,)
MONDAY = datetime(2026, 7, 13, tzinfo=timezone.utc)  # this run reads 2026-w28
IN_WEEK = datetime(2026, 7, 8, 12, tzinfo=timezone.utc)
# (person, cell_row, cell_col, visited_at): ann visits (0, 0) three times (two are kept)
# and (0, 1) once; bob (3, 3) once; cyd only outside the grid, dan only in June.
VISITS = [
    *[("ann", 0, 0, IN_WEEK)] * 3,
    ("ann", 0, 1, IN_WEEK),
    ("bob", 3, 3, IN_WEEK),
    ("cyd", 9, 9, IN_WEEK),
    ("dan", 0, 0, datetime(2026, 6, 1, tzinfo=timezone.utc)),
]
BOUNDED = {0: 2, 1: 1, 15: 1}  # grid position -> visits kept by the DAG's bounds
SIGMA = 3.0 * 4.0  # the DAG's noise multiplier times its derived L2 sensitivity


@pytest.fixture
def visits_db(monkeypatch):
    """A visits table, as the DAG's docstring sets it up, in a database apart from the
    ledger's, named by connection ``visits_db``."""
    with scratch_database("dpb_example_visits") as (name, url):
        engine = sa.create_engine(url)
        with engine.begin() as connection:
            connection.execute(
                sa.text(
                    "CREATE TABLE visits (person TEXT NOT NULL, cell_row INTEGER NOT NULL, "
                    "cell_col INTEGER NOT NULL, visited_at TIMESTAMPTZ NOT NULL)"
                )
            )
            connection.execute(
                sa.text("INSERT INTO visits VALUES (:p, :r, :c, :t)"),
                [{"p": p, "r": r, "c": c, "t": t} for p, r, c, t in VISITS],
            )
        engine.dispose()
        postgres = {
            "conn_type": "postgres",
            "host": engine.url.host,
            "port": engine.url.port,
            "login": engine.url.username,
            "schema": name,
        }
        monkeypatch.setenv("AIRFLOW_CONN_VISITS_DB", json.dumps(postgres))
        yield


def test_the_example_releases_a_heatmap_of_its_postgres_visits(ledger, visits_db):  # noqa: F811
    dag = load_dag(DAG_FILE.read_text().replace('"example_dp_visits_heatmap"', '"DAG_ID"'))
    dag_run = dag.test(logical_date=MONDAY)
    assert task_states(dag_run) == {"release_visits_heatmap": "success"}
    values = stored_xcom(dag_run, "release_visits_heatmap", "return_value")["values"]
    assert len(values) == 16 and all(isinstance(value, int) for value in values)
    # Noise of sigma 12 per cell: 6 sigma apart has odds below 1e-8 per cell.
    assert all(abs(values[i] - BOUNDED.get(i, 0)) < 6 * SIGMA for i in range(16))
    receipt = stored_xcom(dag_run, "release_visits_heatmap", "dp_budget_receipt")
    assert receipt["keys"] == 2 and receipt["windows"] == [WINDOW]

    def charged(person: str) -> float:
        return ledger.epsilon_of(key_for(person, "visits_heatmap", WINDOW, tenant="acme"))

    assert charged("ann") == charged("bob") == pytest.approx(receipt["epsilon"])
    assert receipt["epsilon"] > 0
    assert charged("cyd") == 0 and charged("dan") == 0
