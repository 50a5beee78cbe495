"""DPReleaseOperator keeps its reservation's lease alive while the callable runs (dag.test on
a real Airflow metadata DB; ledger on SQLite and PostgreSQL): a live task is never reaped,
a task that outlived its lease is charged once (by the reap), and a task SIGKILLed mid-query
is charged by the first reap after its lease ran out.

``[dp_budget] lease_seconds`` is 1.5 here (renewals every half second).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from dp_budget_provider.ledger import PrivacyBudgetLedger, key_for
from tests.ledger_time import ledger_time_at, this_week
from tests.operators.test_release import (
    DISCRETE_Z4,
    KEY,
    WINDOW,
    expected_eps,
    release_source,
    run_release,
)

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

# dag.test() runs the task in this process: the ledger's clock is pinned inside the window.
LEDGER_WINDOWS = (WINDOW,)
LEASE_SECONDS = 1.5
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def short_lease(monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__LEASE_SECONDS", str(LEASE_SECONDS))


def reservation_row(ledger: PrivacyBudgetLedger) -> tuple[str, str, str]:
    with ledger.reading() as connection:
        return tuple(
            connection.exec_driver_sql(
                "SELECT state, created_at, lease_expires_at FROM dp_reservations"
            ).one()
        )


def test_a_task_renews_its_lease_while_its_query_runs_and_is_never_reaped(
    ledger, ledger_url, tmp_path
):
    """The callable outlives two leases, reaping meanwhile from a ledger of its own: its
    own reservation is not due. The renewals went on until the callable returned."""
    seen = tmp_path / "reaped-meanwhile.json"
    body = (
        "import time; from dp_budget_provider.ledger import PrivacyBudgetLedger, key_for; "
        f"time.sleep({2 * LEASE_SECONDS}); other = PrivacyBudgetLedger(url={ledger_url!r}); "
        f"pathlib.Path({str(seen)!r}).write_text(json.dumps(other.reap())); other.close(); "
        "return [[3, 1], [0, 7]]"
    )
    dag_run, result, ran = run_release(tmp_path, body=body)
    assert str(dag_run.state) == "success" and ran
    assert json.loads(seen.read_text()) == []
    state, created, lease = reservation_row(ledger)
    assert state == "committed" and lease > created
    assert [e["action"] for e in ledger.history(KEY)] == ["reserve", "commit"]
    assert ledger.verify().ok


def test_a_task_that_outlived_its_lease_is_charged_once_by_the_reap(
    ledger, ledger_url, tmp_path, capfd
):
    """Reaped mid-query (its lease seen as run out): the renewals stop with a warning in
    the task log, the release still publishes, and its commit charges nothing more."""
    body = (
        "import time; from datetime import datetime, timedelta, timezone; "
        "from dp_budget_provider.ledger import PrivacyBudgetLedger, key_for; "
        f"other = PrivacyBudgetLedger(url={ledger_url!r}); "
        "later = datetime.now(timezone.utc) + timedelta(hours=1); "
        "assert len(other.reap(now=later)) == 1; other.close(); "
        f"time.sleep({LEASE_SECONDS}); return [[3, 1], [0, 7]]"
    )
    dag_run, result, ran = run_release(tmp_path, body=body)
    assert str(dag_run.state) == "success" and ran
    log = capfd.readouterr().out  # dag.test writes the task log there
    reservation_id = ledger.history(KEY)[-1]["reservation_id"]
    assert f"the lease of reservation {reservation_id} is no longer renewed" in log
    assert "was reaped at" in log
    assert [e["action"] for e in ledger.history(KEY)] == ["reserve", "reap"]
    assert result["receipt"]["epsilon"] == pytest.approx(expected_eps(DISCRETE_Z4), rel=1e-12)
    assert ledger.epsilon_of(KEY) == pytest.approx(expected_eps(DISCRETE_Z4), rel=1e-12)
    assert ledger.verify().ok


KILLED_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from tests.airflow.dag_runner import load_dag
load_dag({source!r}).test()
"""


def test_a_task_killed_mid_query_is_charged_after_its_lease(
    airflow_db, ledger, ledger_url, tmp_path, monkeypatch
):
    """A worker process running the task is SIGKILLed while the callable runs: no commit,
    no finally. The reap after its lease ran out charges the attempt, once."""
    # The worker process runs on the real clock: it charges the real week, and this
    # process reaps on the real clock too (the lease was stamped by it).
    ledger_time_at(monkeypatch, datetime.now(timezone.utc))
    key = key_for("alice", "heatmap", this_week())
    started = tmp_path / "out.ran"
    source = release_source(
        tmp_path / "out.json", body="import time; time.sleep(600)", window=key.window
    )
    home = tmp_path / "airflow-home"  # the session's migrated metadata DB, copied
    shutil.copytree(airflow_db, home, ignore=shutil.ignore_patterns("dags", "logs"))
    (home / "dags").mkdir()
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
    }
    worker = subprocess.Popen(
        [sys.executable, "-c", KILLED_SCRIPT.format(root=str(ROOT), source=source)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not started.exists():
            assert worker.poll() is None, worker.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the task never started its callable"
            time.sleep(0.2)
        time.sleep(2 * LEASE_SECONDS)  # alive and renewing: never due
        assert ledger.reap() == []
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        killed = time.monotonic()
        reaped: list[str] = []
        while not reaped:
            assert time.monotonic() - killed < 30, "the killed task was never reaped"
            time.sleep(0.2)
            reaped = ledger.reap()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(30)
    assert [e["action"] for e in ledger.history(key)] == ["reserve", "reap"]
    assert "its lease ran out at" in ledger.history(key)[-1]["payload"]["reason"]
    assert ledger.epsilon_of(key) == pytest.approx(expected_eps(DISCRETE_Z4), rel=1e-12)
    assert ledger.verify().ok
