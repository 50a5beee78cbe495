"""Moving the ledger's time in tests: patching ``clock.now`` (``ledger/clock.py``), in this
process only (a worker process the test starts keeps the real clock)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from dp_budget_provider.ledger import clock


def ledger_time_at(monkeypatch: Any, moment: datetime) -> None:
    """From now on the ledger's clock reads ``moment`` plus the time that has passed since
    this call: it still runs (leases run out, ages grow), from a moment the test chose."""
    started = clock.process_now()
    monkeypatch.setattr(clock, "now", lambda: moment + (clock.process_now() - started))
