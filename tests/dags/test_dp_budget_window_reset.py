"""The maintenance DAGs: closed windows reset, open ones untouched, abandoned reservations
charged (by the daily run, and every few minutes by ``dp_budget_reap`` once their lease ran
out)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg2
import pytest
from sqlalchemy.engine import make_url

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    LedgerQuarantined,
    PrivacyBudgetLedger,
    WindowCalendar,
    key_for,
)
from dp_budget_provider.ledger.audit.checkpoints import Checkpoint
from dp_budget_provider.ledger.storage import history
from tests.admin import ADMIN
from tests.airflow.dag_runner import ledger_connection, load_dag, task_states
from tests.ledger_time import ledger_time_in
from tests.scratch_postgres import PG_ADMIN_DSN

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

RESET_DAG = Path(__file__).resolve().parents[2] / "dags" / "dp_budget_window_reset.py"
REAP_DAG = RESET_DAG.with_name("dp_budget_reap.py")


CHECKPOINT_VARIABLE = "dp_budget_checkpoint.dp_budget_default"


@pytest.fixture(autouse=True)
def no_checkpoint_yet(airflow_db):
    """Each test's ledger is new behind the same connection id: a checkpoint left by an
    earlier test would (rightly) be refused as another ledger's."""
    from airflow.models import Variable

    Variable.delete(CHECKPOINT_VARIABLE)


def run_reset_dag():
    return load_dag(RESET_DAG.read_text().replace('"dp_budget_window_reset"', '"DAG_ID"')).test()


def test_the_reap_dag_charges_run_out_leases_every_five_minutes(
    airflow_db, ledger_url, monkeypatch
):
    """A reservation whose lease ran out (its worker stopped renewing) is charged; a fresh
    one, whose attempt may still be running, is not (the age bound is a day)."""
    ledger = PrivacyBudgetLedger(
        admin=ADMIN, cap=BudgetCap(3.0, 1e-5), url=ledger_url, lease=timedelta(seconds=1)
    )
    ledger_connection(monkeypatch, ledger_url)
    current = WindowCalendar("iso_week").window_of(datetime.now(timezone.utc))
    dead_key, live_key = key_for("dead", "heatmap", current), key_for("live", "heatmap", current)
    dead = ledger.reserve([dead_key], GaussianMechanism(4.0))
    time.sleep(1.1)
    worker = PrivacyBudgetLedger(url=ledger_url)  # the default lease: 5 minutes
    live = worker.reserve([live_key], GaussianMechanism(4.0))
    worker.close()
    dag = load_dag(REAP_DAG.read_text().replace('"dp_budget_reap"', '"DAG_ID"'))
    assert dag.timetable.expression == "*/5 * * * *"  # [dp_budget] reap_schedule
    assert set(task_states(dag.test()).values()) == {"success"}
    assert [r.id for r in ledger.open_reservations()] == [live.id]
    assert ledger.epsilon_of(dead_key) == pytest.approx(dead.prospective_epsilon)
    assert ledger.history()[-1]["action"] == "reap"
    assert ledger.verify().ok
    ledger.close()


def test_reset_dag_reaps_resets_closed_windows_and_verifies(airflow_db, ledger_url, monkeypatch):
    ledger_connection(monkeypatch, ledger_url)
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__REAP_AFTER", "0")
    current = WindowCalendar("iso_week").window_of(datetime.now(timezone.utc))
    closed_key = key_for("alice", "heatmap", "2026-w01")
    open_key = key_for("alice", "heatmap", current)
    with pytest.MonkeyPatch.context() as then:  # released while 2026-w01 was open
        ledger_time_in(then, "2026-w01")
        ledger = PrivacyBudgetLedger(admin=ADMIN, cap=BudgetCap(3.0, 1e-5), url=ledger_url)
        ledger.spend(closed_key, GaussianMechanism(4.0))
    # The rest (the DAG's tasks too, which run in this process) on the real clock.
    ledger.spend(open_key, GaussianMechanism(4.0))
    stale = ledger.reserve([open_key], GaussianMechanism(4.0), attempt="dead-worker/try/1")
    open_before = ledger.epsilon_of(open_key)
    closed_before = ledger.epsilon_of(closed_key)

    dag_run = run_reset_dag()
    assert set(task_states(dag_run).values()) == {"success"}
    # The closed window is sealed: its account left the live ones with its final spend.
    assert ledger.epsilon_of(closed_key) == closed_before > 0
    assert [(s.key, s.state) for s in ledger.accounts(window="2026-w01")] == [
        (closed_key, "SEALED")
    ]
    assert [s.key for s in ledger.accounts()] == [open_key]
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

    with pytest.MonkeyPatch.context() as then:  # released while 2026-w01 was open
        ledger_time_in(then, "2026-w01")
        ledger = PrivacyBudgetLedger(admin=ADMIN, cap=BudgetCap(3.0, 1e-5), url=sqlite_url)
        ledger.spend(key_for("bob", "heatmap", "2026-w01"), GaussianMechanism(4.0))
    ledger_connection(monkeypatch, sqlite_url)
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as connection:
        connection.execute(sa.text("UPDATE dp_history SET actor = 'mallory' WHERE seq = 3"))
    engine.dispose()
    states = task_states(run_reset_dag())
    assert states["verify_and_checkpoint"] == "failed"
    with pytest.MonkeyPatch.context() as then:  # a release that 2026-w02 would take
        ledger_time_in(then, "2026-w02")
        with pytest.raises(LedgerQuarantined):
            ledger.spend(key_for("bob", "heatmap", "2026-w02"), GaussianMechanism(4.0))
    ledger.close()


def test_a_reap_failing_on_an_edited_row_does_not_stop_the_verify(
    airflow_db, sqlite_url, monkeypatch
):
    """An insider deletes the account an open reservation holds, so that reaping it fails,
    and lowers another account's spend. The reap task fails; the verify still runs, finds both and
    quarantines the ledger: an edit that breaks the reap must not also switch off the
    check that would find it (and the lowered spend would then let a release pass the cap)."""
    import sqlalchemy as sa

    ledger = PrivacyBudgetLedger(admin=ADMIN, cap=BudgetCap(3.0, 1e-5), url=sqlite_url)
    ledger_connection(monkeypatch, sqlite_url)
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__REAP_AFTER", "0")
    current = WindowCalendar("iso_week").window_of(datetime.now(timezone.utc))
    bob = key_for("bob", "heatmap", current)
    ledger.spend(bob, GaussianMechanism(4.0))
    ledger.reserve([key_for("dave", "heatmap", current)], GaussianMechanism(4.0))
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as connection:
        connection.execute(sa.text("DELETE FROM dp_accounts WHERE open_reservations > 0"))
        connection.execute(sa.text("UPDATE dp_accounts SET rho = 0, gaussian_mu2 = 0"))
    engine.dispose()
    states = task_states(run_reset_dag())
    assert states["reap_abandoned_reservations"] == "failed"
    assert states["verify_and_checkpoint"] == "failed"  # ran, and found the edits
    assert ledger.quarantine_status() is not None
    with pytest.raises(LedgerQuarantined):
        ledger.spend(bob, GaussianMechanism(4.0))
    ledger.close()


def test_reset_dag_checkpoints_a_keyed_ledger_and_catches_a_rollback(
    airflow_db, postgres_url, monkeypatch
):
    """The verify task checkpoints the chain heads in an Airflow Variable. The ledger
    database restored from an older backup (every table consistent, every link valid)
    fails the next run, because the checkpoint names entries the backup lacks."""
    from airflow.models import Variable

    key = "dag-test-chain-key-0123456789"
    database = make_url(postgres_url).database
    value = json.dumps(
        {
            "conn_type": "dpbudget",
            "extra": {"url": postgres_url, "chain_key": key, "admin_public_key": ADMIN.public.text},
        }
    )
    monkeypatch.setenv("AIRFLOW_CONN_DP_BUDGET_DEFAULT", value)
    current = WindowCalendar("iso_week").window_of(datetime.now(timezone.utc))
    carol = key_for("carol", "heatmap", current)
    ledger = PrivacyBudgetLedger(
        admin=ADMIN, cap=BudgetCap(3.0, 1e-5), url=postgres_url, chain_key=key
    )
    ledger.spend(carol, GaussianMechanism(4.0))
    ledger.close()
    admin = psycopg2.connect(PG_ADMIN_DSN)
    admin.autocommit = True
    with admin.cursor() as cursor:  # the insider's backup, taken before the next release
        cursor.execute(f'CREATE DATABASE "{database}_backup" TEMPLATE "{database}"')
    try:
        ledger = PrivacyBudgetLedger(url=postgres_url, chain_key=key)
        ledger.spend(carol, GaussianMechanism(4.0))
        spent = ledger.epsilon_of(carol)
        ledger.close()
        assert set(task_states(run_reset_dag()).values()) == {"success"}
        stored = Variable.get(CHECKPOINT_VARIABLE)
        checkpoint = Checkpoint.from_json(stored, history.ChainKey(key))
        with admin.cursor() as cursor:  # ... restored: the second release is gone
            cursor.execute(f'DROP DATABASE "{database}" WITH (FORCE)')
            cursor.execute(f'CREATE DATABASE "{database}" TEMPLATE "{database}_backup"')
        ledger = PrivacyBudgetLedger(url=postgres_url, chain_key=key)
        assert ledger.epsilon_of(carol) < spent
        assert ledger.verify(quarantine=False).ok  # consistent: only the checkpoint knows
        assert len(ledger.history()) < checkpoint.entries
        states = task_states(run_reset_dag())
        assert states["verify_and_checkpoint"] == "failed"
        assert Variable.get(CHECKPOINT_VARIABLE) == stored
        with pytest.raises(LedgerQuarantined, match="history truncated"):
            ledger.spend(carol, GaussianMechanism(4.0))
        ledger.close()
    finally:
        with admin.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{database}_backup" WITH (FORCE)')
        admin.close()


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
    # Every file of dags/ defines the DAG its name says (the examples included).
    shipped = {path.stem for path in RESET_DAG.parent.glob("*.py")}
    assert {"dp_budget_window_reset", "dp_budget_reap", "example_dp_visits_heatmap"} <= shipped
    assert shipped <= dag_ids, shipped - dag_ids
    errors = subprocess.run(
        [str(airflow), "dags", "list-import-errors", "--output", "json", "--local"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert "dp_budget" not in errors.stdout, errors.stdout


def test_the_maintenance_dags_ship_unpaused():
    """Airflow pauses new DAGs: left so, crashed attempts are never charged and windows
    never sealed."""
    for path in (RESET_DAG, REAP_DAG):
        dag = load_dag(path.read_text().replace(f'"{path.stem}"', '"DAG_ID"'))
        assert dag.is_paused_upon_creation is False, path.name
