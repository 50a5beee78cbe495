"""The maintenance DAG: closed windows reset, open ones untouched, stale reservations charged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger, WindowCalendar, key_for
from tests.airflow.dag_runner import ledger_connection, load_dag, task_states

RESET_DAG = Path(__file__).resolve().parents[2] / "dags" / "dp_budget_window_reset.py"


def run_reset_dag():
    return load_dag(RESET_DAG.read_text().replace('"dp_budget_window_reset"', '"DAG_ID"')).test()


def test_reset_dag_reaps_resets_closed_windows_and_verifies(airflow_db, ledger_url, monkeypatch):
    ledger = PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=ledger_url)
    ledger_connection(monkeypatch, ledger_url)
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__REAP_AFTER", "0")
    current = WindowCalendar("iso_week").window_of(datetime.now(timezone.utc))
    closed_key = key_for("alice", "heatmap", "2026-w01")
    open_key = key_for("alice", "heatmap", current)
    ledger.spend(closed_key, GaussianMechanism(4.0))
    ledger.spend(open_key, GaussianMechanism(4.0))
    stale = ledger.reserve([open_key], GaussianMechanism(4.0), attempt="dead-worker/try/1")
    open_before = ledger.epsilon_of(open_key)

    dag_run = run_reset_dag()
    assert set(task_states(dag_run).values()) == {"success"}
    assert ledger.epsilon_of(closed_key) == 0.0
    assert ledger.epsilon_of(open_key) == pytest.approx(stale.prospective_epsilon)
    assert ledger.epsilon_of(open_key) > open_before
    assert ledger.open_reservations() == []
    actions = [e["action"] for e in ledger.history()]
    assert actions[-2:] == ["reap", "reset"]

    # Idempotent: a second run changes nothing.
    history_before = ledger.history()
    assert set(task_states(run_reset_dag()).values()) == {"success"}
    assert ledger.history() == history_before
    ledger.close()


def test_reset_dag_fails_when_the_history_was_tampered_with(airflow_db, sqlite_url, monkeypatch):
    import sqlalchemy as sa

    ledger = PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=sqlite_url)
    ledger_connection(monkeypatch, sqlite_url)
    ledger.spend(key_for("bob", "heatmap", "2026-w01"), GaussianMechanism(4.0))
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as connection:
        connection.execute(sa.text("UPDATE dp_history SET actor = 'mallory' WHERE seq = 3"))
    engine.dispose()
    states = task_states(run_reset_dag())
    assert states["verify_history"] == "failed"
    ledger.close()


def test_every_shipped_dag_parses_without_import_errors(airflow_db, tmp_path):
    env = {**os.environ, "AIRFLOW__CORE__DAGS_FOLDER": str(RESET_DAG.parent)}
    airflow = Path(sys.executable).with_name("airflow")
    listed = subprocess.run(
        [str(airflow), "dags", "list", "--output", "json", "--local"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    # The CLI may print log lines before the JSON document: parse from its last line.
    dag_ids = {d["dag_id"] for d in json.loads(listed.stdout.strip().splitlines()[-1])}
    assert {"dp_budget_window_reset", "example_dp_heatmap"} <= dag_ids
    errors = subprocess.run(
        [str(airflow), "dags", "list-import-errors", "--output", "json", "--local"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert "dp_budget" not in errors.stdout, errors.stdout
