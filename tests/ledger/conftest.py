"""Fixtures of the ledger tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dp_budget_provider.ledger import PrivacyBudgetLedger


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
