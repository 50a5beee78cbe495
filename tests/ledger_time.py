"""Moving the ledger's time in tests: patching ``clock.now`` (``ledger/clock.py``), in this
process only (a worker process the test starts keeps the real clock).

A ledger charges a window only from its start until its policy's grace period after its
end, by the ledger's clock. A test that charges fixed, past windows therefore runs with the
ledger's clock inside them: a module names them in ``LEDGER_WINDOWS`` and the suite's
autouse fixture (``tests/conftest.py``) pins the clock there for the whole module, module
fixtures included. A test that starts processes of its own (workers, the CLI, Airflow)
charges the window of the real clock instead: :func:`this_week`.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from dp_budget_provider.ledger.storage import clock
from dp_budget_provider.ledger.windows.calendar import window_bounds
from dp_budget_provider.ledger.windows.policy import DEFAULT_GRACE

# How far into the latest of its windows a pinned clock starts (it then runs).
_INTO = timedelta(hours=1)


def ledger_time_at(monkeypatch: Any, moment: datetime) -> None:
    """From now on the ledger's clock reads ``moment`` plus the time that has passed since
    this call: it still runs (leases run out, ages grow), from a moment the test chose."""
    started = clock.process_now()
    monkeypatch.setattr(clock, "now", lambda: moment + (clock.process_now() - started))


def inside(*windows: str) -> datetime:
    """A moment at which every one of ``windows`` may be charged by a new release under the
    default policy: an hour after the latest of them began, before the grace period of the
    earliest to end is over."""
    if not windows:
        raise ValueError("inside() needs at least one window")
    bounds = [window_bounds(window) for window in windows]
    moment = max(start for start, _ in bounds) + _INTO
    if moment >= min(end for _, end in bounds) + DEFAULT_GRACE:
        raise ValueError(f"no moment lets a new release charge all of {windows}")
    return moment


def ledger_time_in(monkeypatch: Any, *windows: str) -> None:
    """Pin the ledger's clock (running) at :func:`inside` ``windows``."""
    ledger_time_at(monkeypatch, inside(*windows))


def this_week(now: datetime | None = None) -> str:
    """The ISO week label of ``now`` (default: the real clock), as the ledger names it."""
    year, week, _ = (now or datetime.now(timezone.utc)).isocalendar()
    return f"{year}-w{week:02d}"
