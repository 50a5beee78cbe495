"""Fixtures of the ledger tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger
from tests.ledger.legacy import LegacyLedger
from tests.ledger.storage.test_pending_and_server_paths import migrate


@pytest.fixture
def make_ledger() -> Iterator[Callable[..., PrivacyBudgetLedger]]:
    """Open ledgers (``PrivacyBudgetLedger`` arguments), all closed after the test."""
    opened: list[PrivacyBudgetLedger] = []

    def make(*args: Any, **kwargs: Any) -> PrivacyBudgetLedger:
        ledger = PrivacyBudgetLedger(*args, **kwargs)
        opened.append(ledger)
        return ledger

    yield make
    for ledger in opened:
        ledger.close()


@pytest.fixture
def ledger_at(make_ledger) -> Callable[[str, str, BudgetCap], LegacyLedger]:
    """``ledger_at(url, revision, cap)``: a ledger this package created with ``cap`` and
    took down to ``revision`` while empty, and the writer that fills it in SQL as that
    revision's code did (see ``tests/ledger/legacy.py``). Its default cap is checked on
    the reported epsilon, as every cap was before revision 0013."""

    def make(url: str, revision: str, cap: BudgetCap) -> LegacyLedger:
        make_ledger(cap=dataclasses.replace(cap, filter_order="reported"), url=url).close()
        migrate(url, "downgrade", revision)
        return LegacyLedger(url)

    return make
