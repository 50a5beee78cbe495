"""A ledger opened before a fork: parent and child never share a database connection.

Airflow forks (task runners, API server workers). A connection inherited across a fork
is one server session behind two processes: their messages interleave on the socket,
so one process may read the other's answer (a refused reservation read as granted),
and the child closing its copy ends the parent's session. These tests fork real
processes from a process holding a used ledger.
"""

from __future__ import annotations

import gc
import multiprocessing
from collections.abc import Callable
from typing import Any

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger, key_for
from tests.ledger_time import this_week

CAP = BudgetCap(epsilon=1e6, delta=1e-5)
NOISE = GaussianMechanism(50.0)
# This week, by the real clock: the clock the parent (no LEDGER_WINDOWS) and its child read.
PARENT_KEY = key_for("parent", "count", this_week())
CHILD_KEY = key_for("child", "count", this_week())
FORK = multiprocessing.get_context("fork")

MakeLedger = Callable[..., PrivacyBudgetLedger]


def session_of(ledger: PrivacyBudgetLedger) -> Any:
    """The server session a pooled connection of ``ledger`` talks to."""
    with ledger.reading() as connection:
        if connection.dialect.name == "postgresql":
            return connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        return connection.exec_driver_sql("SELECT count(*) FROM dp_accounts").scalar_one()


def child(ledger: PrivacyBudgetLedger, results: Any) -> None:
    """Use the inherited ledger, then close it, as a task ending does: closing disposes
    of its pool, inherited connections included."""
    try:
        session = session_of(ledger)
        receipt = ledger.spend(CHILD_KEY, NOISE)
        results.put((session, receipt.epsilon))
    except BaseException as error:  # report, never hang the parent
        results.put(repr(error))
    finally:
        ledger.close()
        gc.collect()


def run_child(ledger: PrivacyBudgetLedger) -> Any:
    results = FORK.Queue()
    process = FORK.Process(target=child, args=(ledger, results))
    process.start()
    got = results.get(timeout=120)
    process.join(120)
    assert process.exitcode == 0
    return got


def test_a_forked_child_gets_its_own_postgres_sessions_and_leaves_the_parents_alive(
    postgres_url: str, make_ledger: MakeLedger
) -> None:
    ledger = make_ledger(cap=CAP, url=postgres_url)
    ledger.spend(PARENT_KEY, NOISE)  # the pool and the kept connection are in use
    parent_session = session_of(ledger)
    got = run_child(ledger)
    assert not isinstance(got, str), got
    child_session, child_epsilon = got
    assert child_session != parent_session
    assert child_epsilon > 0
    # The parent's connections survived the child's exit and still work.
    assert session_of(ledger) == parent_session
    ledger.spend(PARENT_KEY, NOISE)
    assert ledger.epsilon_of(CHILD_KEY) == child_epsilon
    assert ledger.verify().ok


def test_a_forked_child_releases_on_an_inherited_sqlite_ledger(
    sqlite_url: str, make_ledger: MakeLedger
) -> None:
    """SQLite has no session to compare: the child's release and the parent's next one
    both land, and the history still verifies."""
    ledger = make_ledger(cap=CAP, url=sqlite_url)
    ledger.spend(PARENT_KEY, NOISE)
    got = run_child(ledger)
    assert not isinstance(got, str), got
    assert got[1] > 0
    ledger.spend(PARENT_KEY, NOISE)
    assert ledger.epsilon_of(CHILD_KEY) == got[1]
    assert ledger.verify().ok


def test_the_child_never_touches_the_parents_socket(
    postgres_url: str, make_ledger: MakeLedger
) -> None:
    """Many releases in parent and child at once: every receipt is the process's own."""
    ledger = make_ledger(cap=CAP, url=postgres_url)
    ledger.spend(PARENT_KEY, NOISE)
    results = FORK.Queue()

    def busy_child() -> None:
        try:
            receipts = [ledger.spend(CHILD_KEY, NOISE) for _ in range(40)]
            results.put([r.key for r in receipts])
        except BaseException as error:
            results.put(repr(error))

    process = FORK.Process(target=busy_child)
    process.start()
    parent_receipts = [ledger.spend(PARENT_KEY, NOISE) for _ in range(39)]
    got = results.get(timeout=120)
    process.join(120)
    assert not isinstance(got, str), got
    # A receipt names the account charged: each subject's class (of one), never the other's.
    child_account, parent_account = ledger.account_of(CHILD_KEY), ledger.account_of(PARENT_KEY)
    assert child_account != parent_account
    assert set(got) == {child_account}
    assert {r.key for r in parent_receipts} == {parent_account}
    assert ledger.receipt(CHILD_KEY).epsilon == ledger.receipt(PARENT_KEY).epsilon
    assert ledger.verify().ok


def close_only(ledger: PrivacyBudgetLedger) -> None:
    ledger.close()
    gc.collect()


def test_a_child_closing_an_inherited_ledger_leaves_the_parents_session_alive(
    postgres_url: str, make_ledger: MakeLedger
) -> None:
    """The child's copy of the kept connection goes back to the child's pool, which
    closing the ledger closes: libpq's goodbye must not reach the parent's session."""
    ledger = make_ledger(cap=CAP, url=postgres_url)
    ledger.spend(PARENT_KEY, NOISE)  # the server-call connection stays checked out
    process = FORK.Process(target=close_only, args=(ledger,))
    process.start()
    process.join(120)
    assert process.exitcode == 0
    receipt = ledger.spend(PARENT_KEY, NOISE)
    assert receipt.epsilon > 0
    assert ledger.verify().ok
