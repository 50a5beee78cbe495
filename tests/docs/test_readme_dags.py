"""The DAG examples marked ``<!-- runnable-dag -->`` in the README and the guides under
``docs/`` (every Markdown file of the project) load and run as written, so the
documentation cannot drift from the operator's and the decorator's signatures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dp_budget_provider.ledger import PrivacyBudgetLedger
from tests.airflow.dag_runner import ledger_connection, load_dag, task_states
from tests.docs.markdown import ROOT, code_blocks, markdown_files
from tests.ledger_time import ledger_time_in, this_week

# (document relative to the root, block) for every marked block of every Markdown file
RUNNABLE = [
    (path.relative_to(ROOT).as_posix(), block)
    for path in markdown_files()
    for block in code_blocks(path.read_text())
    if block.runnable
]


def where(example) -> str:
    document, block = example
    return f"{document}:{block.line}"


def test_the_docs_mark_their_dag_examples():
    documents = [document for document, _block in RUNNABLE]
    assert documents.count("README.md") >= 1  # the landing page's minimal DAG
    assert documents.count("docs/operators.md") >= 2  # the operator's and TaskFlow's
    assert len(RUNNABLE) >= 3
    assert all(block.language == "python" for _document, block in RUNNABLE)


@pytest.fixture(autouse=True)
def no_trace() -> Iterator[None]:
    """An example may set up what it needs in the process it is imported in (the SQLite
    one defines its source's connection in ``os.environ``), and its file stays in the
    dags folder, which later ``dag.test()`` runs parse again: both are undone after each
    test, so that no later test's connection of the same name is the example's."""
    environ = dict(os.environ)
    folder = Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    before = set(folder.iterdir())
    yield
    for path in set(folder.iterdir()) - before:
        path.unlink()
    os.environ.clear()
    os.environ.update(environ)


@pytest.mark.parametrize("example", RUNNABLE, ids=where)
def test_a_runnable_dag_example_loads(example):
    _document, block = example
    compile(block.text, where(example), "exec")  # a SyntaxError names the line
    dag = load_dag(block.text)
    assert dag.task_ids, "the example defines no task"


@pytest.mark.parametrize("example", RUNNABLE, ids=where)
def test_a_runnable_dag_example_releases_on_a_fresh_ledger(
    airflow_db, sqlite_url, monkeypatch, example
):
    """Run as written with ``dag.test()``: every task succeeds and the release is charged.

    ``dag.test()`` runs the tasks in this process; a weekly run's data interval is the ISO
    week before this one, so the ledger's clock is an hour into this week, as when the
    scheduler starts that run (later, past the grace period, the week takes no release)."""
    _document, block = example
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
