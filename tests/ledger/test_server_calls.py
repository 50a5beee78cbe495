"""The connection a PostgreSQL ledger keeps for its one-call reserve and commit.

``pipeline.ServerCalls`` keeps one pooled connection checked out instead of checking
one out and in around every call. These tests hold it to what the pool gave before:
a lost connection fails the call cleanly (nothing written) and is replaced, an idle
one is pinged again, a call from a second thread never waits for the first, and
closing the ledger gives the connection back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    LedgerUnavailable,
    PrivacyBudgetLedger,
    database,
    key_for,
)
from tests.ledger.test_pending_and_server_paths import execute, scalar, snapshot

CAP = BudgetCap(epsilon=1e6, delta=1e-5)
NOISE = GaussianMechanism(50.0)
KEY = key_for("subject", "count", "2026-11")

MakeLedger = Callable[..., PrivacyBudgetLedger]


def kept_backend(ledger: PrivacyBudgetLedger) -> int | None:
    """The server process behind the ledger's kept connection (None while none is kept)."""
    held = ledger._server._held
    if held is None:
        return None
    cursor = held.dbapi_connection.cursor()
    cursor.execute("SELECT pg_backend_pid()")
    return cursor.fetchone()[0]


def release(ledger: PrivacyBudgetLedger, **kwargs: Any) -> None:
    ledger.commit(ledger.reserve(KEY, NOISE, **kwargs))


def ledger_backends(url: str) -> int:
    return scalar(
        url,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'dp-budget-ledger' "
        "AND datname = current_database()",
    )


def test_reserve_and_commit_share_one_kept_connection(
    postgres_url: str, make_ledger: MakeLedger
) -> None:
    ledger = make_ledger(cap=CAP, url=postgres_url)
    release(ledger)
    backend = kept_backend(ledger)
    assert backend is not None
    for _ in range(5):
        release(ledger)
    assert kept_backend(ledger) == backend
    assert ledger.epsilon_of(KEY) > 0


def test_close_gives_the_connection_back(postgres_url: str) -> None:
    ledger = PrivacyBudgetLedger(cap=CAP, url=postgres_url)
    release(ledger)
    assert ledger_backends(postgres_url) >= 1
    ledger.close()
    assert ledger._server._held is None
    assert ledger_backends(postgres_url) == 0


def test_a_lost_connection_fails_the_call_writes_nothing_and_is_replaced(
    postgres_url: str, make_ledger: MakeLedger
) -> None:
    ledger = make_ledger(cap=CAP, url=postgres_url)
    release(ledger)
    backend = kept_backend(ledger)
    execute(postgres_url, "SELECT pg_terminate_backend(:pid)", pid=backend)
    before = snapshot(postgres_url)
    with pytest.raises(LedgerUnavailable, match="ledger database"):
        ledger.reserve(KEY, NOISE)
    assert snapshot(postgres_url) == before
    release(ledger)  # a new connection, on the next call
    assert kept_backend(ledger) not in (None, backend)
    assert ledger.verify().ok


def test_an_idle_connection_goes_back_to_the_pool_and_is_pinged(
    postgres_url: str, make_ledger: MakeLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = make_ledger(cap=CAP, url=postgres_url)
    release(ledger)
    backend = kept_backend(ledger)
    # Every connection now counts as idle: the kept one goes back to the pool, and the
    # pool pings it on the way out; a dead one is replaced before the call is sent.
    monkeypatch.setattr(database, "IDLE_PING_SECONDS", 0.0)
    execute(postgres_url, "SELECT pg_terminate_backend(:pid)", pid=backend)
    release(ledger)
    assert kept_backend(ledger) not in (None, backend)
    assert ledger.open_reservations() == []


def test_a_call_while_another_is_under_way_takes_a_pooled_connection(
    postgres_url: str, make_ledger: MakeLedger
) -> None:
    ledger = make_ledger(cap=CAP, url=postgres_url)
    release(ledger)
    backend = kept_backend(ledger)
    used: list[int] = []
    original = ledger._server._kept_cursor

    def kept_cursor() -> Any:
        cursor = original()
        used.append(kept_backend(ledger))
        return cursor

    ledger._server._kept_cursor = kept_cursor  # type: ignore[method-assign]
    assert ledger._server._lock.acquire(blocking=False)  # another thread's call, in flight
    try:
        release(ledger)
    finally:
        ledger._server._lock.release()
    assert used == []  # neither call waited for the kept connection
    release(ledger)
    assert used == [backend, backend]
    assert ledger.epsilon_of(KEY) > 0


def test_reads_between_server_calls_keep_one_connection_per_ledger(
    postgres_url: str, make_ledger: MakeLedger
) -> None:
    """Each Airflow task opens a ledger: the kept connection goes back to the pool before
    a read or a client-path write, so the ledger holds one connection, not two."""
    ledger = make_ledger(cap=CAP, url=postgres_url)
    for _ in range(3):
        reservation = ledger.reserve(KEY, NOISE)
        assert ledger.epsilon_of(KEY) >= 0  # a read while the connection is kept
        ledger.commit(reservation)
        assert ledger.history(after_seq=0)  # pages wait for settled numbers on the pool
        assert ledger_backends(postgres_url) == 1
        ledger.commit(ledger.reserve(KEY, NOISE))
        ledger.open_reservations()
        ledger.correct(KEY, NOISE, reason="a release the ledger missed")  # client path
        assert ledger_backends(postgres_url) == 1
    assert ledger.verify().ok
    assert ledger_backends(postgres_url) == 1
