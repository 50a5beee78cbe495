"""Which databases a ledger URL opens: every usual PostgreSQL spelling, SQLite paths."""

from __future__ import annotations

import pytest

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    LedgerUnavailable,
    PrivacyBudgetLedger,
    database,
    key_for,
)

ALICE = key_for("alice", "heatmap", "2026-w45")


@pytest.mark.parametrize(
    "scheme", ["postgresql", "postgres", "postgresql+psycopg2", "postgresql+psycopg", "POSTGRESQL"]
)
def test_every_usual_postgresql_url_opens_one_ledger_through_psycopg2(postgres_url, scheme):
    """``postgresql://`` alone makes SQLAlchemy 2.1 load psycopg 3, which is not installed."""
    rest = postgres_url.split("://", 1)[1]
    assert database.parse_url(f"{scheme}://{rest}").drivername == "postgresql+psycopg2"
    written = PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=postgres_url)
    written.spend(ALICE, GaussianMechanism(3.0))
    written.close()
    ledger = PrivacyBudgetLedger(url=f"{scheme}://{rest}")
    try:
        assert ledger.epsilon_of(ALICE) > 0  # the same database, really opened
    finally:
        ledger.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql+asyncpg://u@localhost/db", "through psycopg2, not 'asyncpg'"),
        ("postgresql+pg8000://u@localhost/db", "through psycopg2, not 'pg8000'"),
        ("mysql://u@localhost/db", "unsupported ledger database 'mysql'"),
        ("ledger.db", "not a database URL"),
        ("://nothing", "not a database URL"),
        ("sqlite+nodriver:///x.db", "not a database URL"),
    ],
)
def test_other_urls_are_refused_naming_the_forms_that_work(url, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=url)


def test_a_sqlite_ledger_in_a_missing_folder_names_the_folder(tmp_path):
    missing = tmp_path / "no" / "such" / "folder"
    with pytest.raises(LedgerUnavailable, match=f"the folder {missing} of the SQLite ledger"):
        PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=f"sqlite:///{missing / 'ledger.db'}")
    assert not (tmp_path / "no").exists()
