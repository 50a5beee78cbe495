"""A window past its grace period takes no new release, and drains so the reset can seal it.

Late and backfilled runs may charge a window until its policy's grace period after its
end is over. After that a new reservation (and a budget check) is refused with
:class:`WindowClosed`, the ledger untouched; what already holds a reservation in the
window (commit, renew, release, reap) and an administrator's correction still reach it,
so runs that keep arriving can never keep the reset waiting (``WindowBusy``). Both
backends, on the ledger's clock.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    Policy,
    PrivacyBudgetLedger,
    WindowBusy,
    WindowClosed,
    key_for,
)
from tests.admin import AdminLedger
from tests.ledger_time import ledger_time_at

WEEK = "2026-w28"  # Monday 2026-07-06 to Monday 2026-07-13
ENDED = datetime(2026, 7, 13, tzinfo=timezone.utc)
DURING = ENDED - timedelta(days=2)
MECHANISM = GaussianMechanism(4.0)


def keys(window: str = WEEK, subjects: int = 3) -> list:
    return [key_for(f"u{i}", "heatmap", window, tenant="acme") for i in range(subjects)]


def ledger_rows(url: str) -> dict[str, int]:
    """Row counts of every table a release writes (a refusal must leave them as they were)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return {
                table: connection.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()
                for table in ("dp_accounts", "dp_history", "dp_reservations", "dp_windows")
            }
    finally:
        engine.dispose()


@pytest.fixture
def ledger(ledger_url, monkeypatch):
    ledger_time_at(monkeypatch, DURING)
    opened = AdminLedger(BudgetCap(3.0, 1e-5), url=ledger_url)
    yield opened
    opened.close()


def test_within_its_grace_period_a_closed_window_takes_late_releases(ledger, monkeypatch):
    ledger_time_at(monkeypatch, ENDED + timedelta(days=3) - timedelta(seconds=5))
    assert not ledger.budget_check(keys(), MECHANISM).exceeds
    ledger.commit(ledger.reserve(keys(), MECHANISM))
    assert ledger.epsilon_of(keys()[0]) > 0


def test_past_its_grace_period_a_window_refuses_new_releases_and_is_untouched(
    ledger, ledger_url, monkeypatch
):
    ledger.commit(ledger.reserve(keys(), MECHANISM))
    before = ledger_rows(ledger_url)
    ledger_time_at(monkeypatch, ENDED + timedelta(days=3))
    with pytest.raises(WindowClosed, match=r"'2026-w28'.*grace period of 3 days") as refused:
        ledger.reserve(keys(subjects=5), MECHANISM)
    assert "2026-07-13T00:00:00" in str(refused.value)
    with pytest.raises(WindowClosed):
        ledger.budget_check(keys(), MECHANISM)
    with pytest.raises(WindowClosed):  # a fresh cohort in the window: nothing created
        ledger.reserve(
            ledger.cohort(["v1", "v2"], tenant="acme").in_window("heatmap", WEEK), MECHANISM
        )
    assert ledger_rows(ledger_url) == before
    # The worker's own handle (no administrator key) is refused the same.
    worker = PrivacyBudgetLedger(url=ledger_url)
    try:
        with pytest.raises(WindowClosed):
            worker.reserve(keys(), MECHANISM)
    finally:
        worker.close()
    # The current week still takes releases; the closed one reads its spend.
    ledger.commit(ledger.reserve(keys("2026-w29"), MECHANISM))
    assert ledger.epsilon_of(keys()[0]) > 0 and ledger.verify().ok


def test_what_a_window_holds_drains_after_its_grace_period_and_the_reset_seals_it(
    ledger, monkeypatch
):
    """A reservation opened in time is committed, renewed, released or reaped after the
    grace period; late runs are refused meanwhile; the reset then seals the window."""
    committed = ledger.reserve(keys(), MECHANISM)
    released = ledger.reserve(keys(), MECHANISM)
    reaped = ledger.reserve(keys(), MECHANISM)
    ledger_time_at(monkeypatch, ENDED + timedelta(days=4))
    with pytest.raises(WindowBusy):
        ledger.reset(WEEK)
    with pytest.raises(WindowClosed):
        ledger.reserve(keys(), MECHANISM)
    ledger.renew(committed)
    ledger.commit(committed)
    ledger.release(released, "the task failed before it read the data")
    assert ledger.reap(older_than=timedelta(0)) == [reaped.id]
    charged = ledger.epsilon_of(keys()[0])
    assert charged == pytest.approx(
        ledger.prospective_epsilon(keys("2026-w29")[0], MECHANISM, count=2), rel=1e-9
    )
    assert ledger.reset(WEEK) == 3
    assert ledger.epsilon_of(keys()[0]) == charged  # sealed: the final spend, never zero
    assert ledger.verify().ok


def test_an_administrators_correction_still_reaches_a_window_past_its_grace(ledger, monkeypatch):
    ledger.commit(ledger.reserve(keys(), MECHANISM))
    before = ledger.epsilon_of(keys()[0])
    ledger_time_at(monkeypatch, ENDED + timedelta(days=10))
    after = ledger.correct(keys()[0], MECHANISM, reason="a release the ledger missed").epsilon
    assert after > before and ledger.epsilon_of(keys()[0]) == after


@pytest.mark.parametrize("ledger_url", ["sqlite"], indirect=True)
def test_a_longer_grace_period_keeps_a_window_open_for_backfills(ledger, monkeypatch):
    ledger.set_policy(
        Policy(cap_epsilon=3.0, tenant="acme", query_type="heatmap", grace=timedelta(days=30))
    )
    ledger_time_at(monkeypatch, ENDED + timedelta(days=29))
    ledger.commit(ledger.reserve(keys(), MECHANISM))
    ledger_time_at(monkeypatch, ENDED + timedelta(days=30))
    with pytest.raises(WindowClosed, match="grace period of 30 days"):
        ledger.reserve(keys(), MECHANISM)
