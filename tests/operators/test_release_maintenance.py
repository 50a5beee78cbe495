"""The release task's log warns when the ledger's maintenance is overdue (dag.test)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from dp_budget_provider.ledger import WindowCalendar
from dp_budget_provider.ledger.storage import clock
from tests.airflow.dag_runner import load_dag, task_states
from tests.ledger_time import ledger_time_at

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

DAG_SOURCE = """
from datetime import datetime, timezone
from airflow.sdk import DAG
from dp_budget_provider.operators.release import DPReleaseOperator

with DAG("DAG_ID", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    DPReleaseOperator(
        task_id="release",
        python_callable=lambda: 3.0,
        mechanism={"kind": "gaussian", "noise_multiplier": 4.0},
        l2_sensitivity=1.0,
        subject="alice",
        query_type="heatmap",
        window=WINDOW,
    )
"""


def run_release(window: str) -> str:
    dag_run = load_dag(DAG_SOURCE.replace("WINDOW", repr(window))).test()
    assert task_states(dag_run) == {"release": "success"}
    return window


def test_the_release_log_names_the_overdue_job_and_since_when(ledger, monkeypatch, capfd):
    now = clock.process_now()
    window = WindowCalendar().window_of(now)
    run_release(window)  # a fresh ledger: nothing is overdue yet
    assert "maintenance overdue" not in "".join(capfd.readouterr())

    # Eleven minutes on, the reap (every 5 minutes) has still never run; a reap then
    # takes it off the list, and the daily reset and verify are overdue two days on.
    ledger_time_at(monkeypatch, now + timedelta(minutes=11))
    run_release(window)
    logged = [line for line in "".join(capfd.readouterr()).splitlines() if "overdue" in line]
    assert len(logged) == 1, logged
    assert "WARNING" in logged[0] or "warning" in logged[0]
    assert "ledger maintenance overdue: reap has never run" in logged[0]
    assert "dp_budget_reap DAG paused or failing" in logged[0]
    assert "alice" not in logged[0]

    ledger.reap()
    run_release(window)
    assert "maintenance overdue" not in "".join(capfd.readouterr())
