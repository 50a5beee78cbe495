"""@task.dp_release: the TaskFlow form of DPReleaseOperator, registered through provider info."""

from __future__ import annotations

import json

import pytest

from dp_budget_provider.accounting import RDPAccountant, ZCDPMechanism
from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger, key_for
from tests.admin import ADMIN
from tests.airflow.dag_runner import ledger_connection, load_dag, task_states

# dag.test() runs the tasks in this process: the ledger's clock is pinned inside the window.
LEDGER_WINDOWS = ("2026-w28",)

DECORATED_DAG = """
from datetime import datetime, timezone
import json, pathlib
from airflow.sdk import dag, task

@dag(dag_id="DAG_ID", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc))
def flow():
    @task
    def load_counts():
        return [4, 9, 1]

    @task.dp_release(mechanism={{"kind": "gaussian", "noise_multiplier": 4.0}}, l2_sensitivity=1.0,
                     cells=3, integer=True,
                     subject="{{{{ params.subject }}}}", query_type="counts", window="2026-w28",
                     params={{"subject": "carol"}})
    def clipped_counts(counts):
        return [min(c, 10) for c in counts]

    @task
    def record(noisy):
        pathlib.Path({out!r}).write_text(json.dumps(noisy))

    record(clipped_counts(load_counts()))

dag = flow()
"""


def test_decorated_release_is_charged_and_returns_noise(
    airflow_db, sqlite_url, monkeypatch, tmp_path
):
    ledger = PrivacyBudgetLedger(admin=ADMIN, cap=BudgetCap(3.0, 1e-5), url=sqlite_url)
    ledger_connection(monkeypatch, sqlite_url)
    out = tmp_path / "noisy.json"
    dag_run = load_dag(DECORATED_DAG.format(out=str(out))).test()
    assert task_states(dag_run) == {
        "load_counts": "success",
        "clipped_counts": "success",
        "record": "success",
    }
    noisy = json.loads(out.read_text())
    assert len(noisy) == 3 and noisy != [4, 9, 1]
    assert all(v / 2**-8 == int(v / 2**-8) for v in noisy)  # on the default lattice
    reference = RDPAccountant()
    reference.compose(ZCDPMechanism(rho=1 / 32))  # discrete Gaussian, z = 4, sensitivity 1
    key = key_for("carol", "counts", "2026-w28")
    assert ledger.epsilon_of(key) == pytest.approx(reference.get_epsilon(1e-5)[0], rel=1e-12)
    ledger.close()
