"""Fixtures of the operator tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger
from tests.admin import ADMIN
from tests.airflow.dag_runner import ledger_connection


@pytest.fixture
def ledger(airflow_db, ledger_url, monkeypatch) -> Iterator[PrivacyBudgetLedger]:
    """A ledger (cap eps 3 at delta 1e-5) behind the default dp_budget connection, opened
    by its administrator (the tests read every account through it; tasks get a gate)."""
    ledger = PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=ledger_url, admin=ADMIN)
    ledger_connection(monkeypatch, ledger_url)
    yield ledger
    ledger.close()
