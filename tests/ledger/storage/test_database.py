"""Which databases a ledger URL opens: every usual PostgreSQL spelling, SQLite paths."""

from __future__ import annotations

import pytest

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import BudgetCap, LedgerUnavailable, PrivacyBudgetLedger, key_for
from dp_budget_provider.ledger.storage import database

LEDGER_WINDOWS = ("2026-w45",)
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


@pytest.mark.parametrize(
    "url", ["postgresql:/admin:S3cretPW@db/ledger", "postgresql://admin:S3cretPW@db:port/x"]
)
def test_a_malformed_url_is_refused_without_echoing_its_password(url):
    with pytest.raises(ValueError, match="not a database URL") as refused:
        database.parse_url(url)
    assert "S3cretPW" not in str(refused.value)


@pytest.mark.parametrize("query", ["dbname=postgres", "user=other", "options=-csearch_path%3Dx"])
def test_postgresql_query_parameters_may_not_point_elsewhere(query):
    with pytest.raises(ValueError, match="query names"):
        database.parse_url(f"postgresql://u@localhost/ledger?{query}")
    database.parse_url("postgresql://u@localhost/ledger?sslmode=require&connect_timeout=5")
    database.parse_url("postgresql://u@/ledger?host=/var/run/postgresql")  # a Unix socket


def test_a_relative_sqlite_file_uri_is_refused_and_a_plain_file_name_resolved(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="absolute path"):
        database.parse_url("sqlite:///file:rel.db?uri=true")
    absolute = database.parse_url(f"sqlite:///file:{tmp_path / 'a.db'}?uri=true")
    assert database.sqlite_path(absolute) == tmp_path / "a.db"
    plain = database.parse_url("sqlite:///file:rel.db")  # no uri=true: a file named so
    assert plain.database == str(tmp_path / "file:rel.db")
