"""The README's DAG examples marked ``<!-- runnable-dag -->`` load as written, so the
documentation cannot drift from the operator's and the decorator's signatures."""

from __future__ import annotations

import pytest

from dp_budget_provider.ledger import PrivacyBudgetLedger
from tests.airflow.dag_runner import ledger_connection, load_dag, task_states
from tests.docs.markdown import ROOT, code_blocks
from tests.ledger_time import ledger_time_in, this_week

README = ROOT / "README.md"
RUNNABLE = [block for block in code_blocks(README.read_text()) if block.runnable]


def test_the_readme_marks_its_dag_examples():
    assert len(RUNNABLE) >= 2
    assert all(block.language == "python" for block in RUNNABLE)


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: f"README.md:{b.line}")
def test_a_runnable_readme_dag_loads(block):
    compile(block.text, f"README.md:{block.line}", "exec")  # a SyntaxError names the line
    dag = load_dag(block.text)
    assert dag.task_ids, "the example defines no task"


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: f"README.md:{b.line}")
def test_a_runnable_readme_dag_releases_on_a_fresh_ledger(
    airflow_db, sqlite_url, monkeypatch, block
):
    """Run as written with ``dag.test()``: every task succeeds and the release is charged.

    ``dag.test()`` runs the tasks in this process; a weekly run's data interval is the ISO
    week before this one, so the ledger's clock is an hour into this week, as when the
    scheduler starts that run (later, past the grace period, the week takes no release)."""
    ledger_time_in(monkeypatch, this_week())
    ledger_connection(monkeypatch, sqlite_url, admin_public_key=None)  # the task creates it
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__ALLOW_UNPINNED", "True")  # (a development ledger)
    dag_run = load_dag(block.text).test()
    assert set(task_states(dag_run).values()) == {"success"}, task_states(dag_run)
    ledger = PrivacyBudgetLedger(url=sqlite_url)
    try:
        charged = ledger.accounts(limit=None)
    finally:
        ledger.close()
    assert len(charged) == 50 and all(account.epsilon > 0 for account in charged)
