"""@task.dp_aggregate: the TaskFlow form of DPAggregateOperator, registered through provider
info. The decorated function returns the contribution query (here built from an upstream
task's output); the task releases its bounded counts exactly as the operator does (tiny
noise under a huge cap: every lattice draw is 0) and charges the units it read. A
function that returns no SQL text fails before anything is charged."""

from __future__ import annotations

import pytest

from dp_budget_provider.ledger import BudgetCap, Policy, PrivacyBudgetLedger, key_for
from tests.admin import ADMIN
from tests.airflow.dag_runner import (
    WEEKLY_DAG,
    ledger_connection,
    load_dag,
    stored_xcom,
    task_states,
)
from tests.operators.test_aggregate import DOMAIN, MONDAY, source  # noqa: F401 (a fixture)

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

LEDGER_WINDOWS = ("2026-w28",)
DAG_SOURCE = (
    WEEKLY_DAG.replace("{", "{{").replace("}", "}}")
    + """
from airflow.sdk import task

with weekly() as dag:
    @task
    def table():
        return "visits"

    @task.dp_aggregate(
        conn_id="visits_db",
        privacy_unit="person",
        group_by=["row", "col"],
        domain={domain!r},
        max_groups_per_unit=2,
        max_rows_per_group=2,
        mechanism={{"kind": "gaussian", "noise_multiplier": 0.01}},
        granularity=1,
        query_type="visit_map",
    )
    def visit_map(name):
        return {query}

    visit_map(table())
"""
)
QUERY = (
    'f\'SELECT person, "row", col FROM {name} '
    "WHERE day >= :data_interval_start AND day < :data_interval_end'"
)


@pytest.fixture
def ledger(airflow_db, sqlite_url, monkeypatch):
    ledger = PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=sqlite_url, admin=ADMIN)
    ledger.set_policy(Policy(1e6, query_type="visit_map"))  # tiny noise needs a huge cap
    ledger_connection(monkeypatch, sqlite_url)
    yield ledger
    ledger.close()


def run(query: str):
    dag_run = load_dag(DAG_SOURCE.format(domain=DOMAIN, query=query)).test(logical_date=MONDAY)
    return dag_run, task_states(dag_run)


@pytest.mark.usefixtures("source")
def test_the_decorated_function_gives_the_query_the_task_releases(ledger):
    dag_run, states = run(QUERY)
    assert states == {"table": "success", "visit_map": "success"}
    released = stored_xcom(dag_run, "visit_map", "return_value")
    assert released["values"] == [2, 1, 1]  # as DPAggregateOperator releases it
    assert len(released["intervals"]) == 3
    ann = ledger.epsilon_of(key_for("ann", "visit_map", "2026-w28"))
    assert ann > 0 and ledger.epsilon_of(key_for("bob", "visit_map", "2026-w28")) == ann
    assert ledger.epsilon_of(key_for("cyd", "visit_map", "2026-w28")) == 0


@pytest.mark.usefixtures("source")
def test_a_function_that_returns_no_sql_fails_and_charges_nothing(ledger):
    before = ledger.history()
    _, states = run("None")
    assert states["visit_map"] == "failed"
    assert ledger.history() == before
