"""The cap cannot be walked around: windows, seals, rescopes, attempts, inputs (SQLite and PG).

Each test is one way past the cap that an earlier version allowed, tried again.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism, RDPAccountant
from dp_budget_provider.ledger import (
    BudgetCap,
    BudgetExhausted,
    LedgerError,
    Policy,
    WindowBusy,
    WindowCalendar,
    WindowSealed,
    key_for,
)
from dp_budget_provider.ledger.storage import clock as ledger_clock
from tests.admin import ADMIN, AdminLedger
from tests.ledger.storage.test_pending_and_server_paths import execute, migrate, scalar
from tests.ledger.test_ledger import snapshot
from tests.ledger_time import ledger_time_at, ledger_time_in

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

UTC = timezone.utc
DELTA = 1e-5
RELEASE = GaussianMechanism(2.0)
LEDGER_WINDOWS = ("2026-w45",)
# 2026-w45 ended on 2026-11-09, its grace period on 2026-11-12: past it (it may be reset),
# and inside 2026-w46, which may still be charged.
W45_CLOSED = datetime(2026, 11, 13, tzinfo=UTC)


@pytest.fixture
def ledger(ledger_url, make_ledger):
    return make_ledger(BudgetCap(3.0, DELTA), url=ledger_url, admin=ADMIN)


def fill(ledger, key):
    """Spend on ``key`` until the next RELEASE is refused; returns the eps reached."""
    with pytest.raises(BudgetExhausted):  # noqa: PT012 - loop until the cap refuses
        for _ in range(100):
            ledger.spend(key, RELEASE)
    return ledger.epsilon_of(key)


# ---------------------------------------------------------------- windows are the ledger's


@pytest.mark.parametrize(
    "label",
    [
        "2026-12",  # a month under an ISO-week calendar
        "2026-12-01",  # a day
        "2026-12-01t00:00:00z+1s",  # a one-second fixed window
        "2026-11-30t00:00:00z+604800s",  # a week-long fixed window, same days as 2026-w49
        "anything-else",
        "2025-w53",  # 2025 has 52 ISO weeks
        "2026-w7",  # not zero-padded
    ],
)
def test_one_period_of_data_has_one_window_name(ledger_url, ledger, label):
    """Each label names the data of the week already charged to the cap under 2026-w45:
    every alias is refused, naming the form the calendar expects, and writes nothing."""
    fill(ledger, key_for("alice", "heatmap", "2026-w45"))
    before = snapshot(ledger_url)
    with pytest.raises(ValueError, match="expected an ISO week such as 2026-w49"):
        ledger.spend(key_for("alice", "heatmap", label), RELEASE)
    assert snapshot(ledger_url) == before


def test_a_window_that_has_not_begun_is_refused(ledger):
    future = WindowCalendar().window_of(datetime.now(UTC) + timedelta(days=14))
    with pytest.raises(ValueError, match="has not begun"):
        ledger.spend(key_for("alice", "heatmap", future), RELEASE)
    with pytest.raises(ValueError, match="has not begun"):
        ledger.correct(key_for("alice", "heatmap", future), RELEASE, reason="test")


def test_a_data_interval_is_charged_to_every_window_it_overlaps(ledger):
    assert ledger.windows_for(
        "default", "heatmap", datetime(2026, 11, 22, tzinfo=UTC), datetime(2026, 11, 29, tzinfo=UTC)
    ) == ["2026-w47", "2026-w48"]
    assert ledger.windows_for(
        "default", "heatmap", datetime(2026, 11, 23, tzinfo=UTC), datetime(2026, 11, 30, tzinfo=UTC)
    ) == ["2026-w48"]
    ledger.set_policy(Policy(3.0, query_type="daily", calendar=WindowCalendar("day")))
    assert ledger.windows_for(
        "default",
        "daily",
        datetime(2026, 11, 29, 23, tzinfo=UTC),
        datetime(2026, 12, 1, 1, tzinfo=UTC),
    ) == ["2026-11-29", "2026-11-30", "2026-12-01"]
    with pytest.raises(ValueError, match="ends"):
        ledger.windows_for(
            "default",
            "heatmap",
            datetime(2026, 11, 29, tzinfo=UTC),
            datetime(2026, 11, 1, tzinfo=UTC),
        )


def test_a_charged_scope_keeps_its_calendar(ledger_url, ledger):
    ledger.spend(key_for("alice", "heatmap", "2026-w45"), RELEASE)
    before = snapshot(ledger_url)
    for policy in (
        Policy(3.0, calendar=WindowCalendar("day")),  # the default, which heatmap uses
        Policy(3.0, query_type="heatmap", calendar=WindowCalendar("month")),
        Policy(3.0, tenant="default", calendar=WindowCalendar("fixed", 86400 * 7)),
    ):
        with pytest.raises(LedgerError, match="second set of windows"):
            ledger.set_policy(policy)
    assert snapshot(ledger_url) == before
    # The same calendar (a new cap) and new, uncharged scopes are fine.
    ledger.set_policy(Policy(2.5, query_type="heatmap"))
    ledger.set_policy(Policy(2.5, query_type="counts", calendar=WindowCalendar("day")))


# ---------------------------------------------------------------- closing never refunds


def test_a_reset_window_is_sealed_and_never_charged_again(ledger_url, ledger, monkeypatch):
    key = key_for("alice", "heatmap", "2026-w45")
    reached = fill(ledger, key)
    ledger_time_at(monkeypatch, W45_CLOSED)
    assert ledger.reset("2026-w45") == 1
    before = snapshot(ledger_url)
    for attempt in (
        lambda: ledger.spend(key, RELEASE),
        lambda: ledger.reserve([key_for("carol", "heatmap", "2026-w46"), key], RELEASE),
        lambda: ledger.correct(key, RELEASE, reason="late"),
        lambda: ledger.rescope(key, key_for("alice", "trajectory", "2026-w45")),
    ):
        with pytest.raises(WindowSealed, match="sealed"):
            attempt()
    assert snapshot(ledger_url) == before
    # The lifetime spend in the week stays what it was when the window closed.
    lifetime = [e for e in ledger.history() if e["action"] == "commit"]
    accountant = RDPAccountant()
    accountant.compose(RELEASE, len(lifetime))
    assert accountant.get_epsilon(DELTA)[0] == pytest.approx(reached, rel=1e-12) and reached <= 3
    # Another scope never charged in that week is not sealed by it: it has nothing to refund
    # (and its own, longer grace period lets it charge the week still).
    ledger.set_policy(Policy(3.0, query_type="count", grace=timedelta(days=10)))
    ledger.spend(key_for("alice", "count", "2026-w45"), RELEASE)
    assert ledger.verify().ok


def test_the_grace_period_keeps_a_window_open_for_late_runs(ledger, monkeypatch):
    ledger.set_policy(Policy(3.0, query_type="slow", grace=timedelta(days=10)))
    ledger.spend(key_for("alice", "heatmap", "2026-w45"), RELEASE)
    ledger.spend(key_for("alice", "slow", "2026-w45"), RELEASE)
    # 2026-w45 ended on 2026-11-09; 5 days later only the default 3-day grace is over.
    monkeypatch.setattr(ledger_clock, "now", lambda: datetime(2026, 11, 14, tzinfo=UTC))
    assert ledger.reset_closed() == {}  # one scope still in grace: the window waits
    with pytest.raises(LedgerError, match="grace period of 10 days"):
        ledger.reset("2026-w45")
    ledger.spend(key_for("bob", "slow", "2026-w45"), RELEASE)  # a late run still lands
    monkeypatch.setattr(ledger_clock, "now", lambda: datetime(2026, 11, 20, tzinfo=UTC))
    assert ledger.reset_closed() == {"2026-w45": 3}
    assert ledger.verify().ok


def test_a_window_with_open_reservations_does_not_hold_up_the_other_resets(ledger, monkeypatch):
    ledger_time_in(monkeypatch, "2026-w44", "2026-w45")
    held = ledger.reserve(key_for("alice", "heatmap", "2026-w44"), RELEASE)
    ledger.spend(key_for("alice", "heatmap", "2026-w45"), RELEASE)
    ledger_time_in(monkeypatch, "2026-w46")
    ledger.spend(key_for("bob", "heatmap", "2026-w46"), RELEASE)
    ledger_time_at(monkeypatch, datetime(2026, 11, 20, tzinfo=UTC))  # all three past grace
    with pytest.raises(WindowBusy) as busy:
        ledger.reset_closed()
    assert "reset 2026-w45 (1 accounts), 2026-w46 (1 accounts)" in str(busy.value)
    assert "'2026-w44' has 1 account(s) with open reservations" in str(busy.value)
    assert [a.key.window for a in ledger.accounts()] == ["2026-w44"]
    ledger.commit(held)
    assert ledger.reset_closed() == {"2026-w44": 1}
    assert ledger.accounts() == [] and ledger.verify().ok


def test_windows_that_never_close_do_not_break_maintenance(ledger_url, ledger, monkeypatch):
    """A far-future or free-form window left by an earlier version is never reset, and
    every other window still is."""
    ledger.spend(key_for("alice", "heatmap", "2026-w45"), RELEASE)
    for label in ("9999-12-31", "9999-w52", "9999-12", "campaign-q3"):
        execute(
            ledger_url,
            'INSERT INTO dp_windows (tenant, query_type, "window", created_at) '
            "VALUES ('default', 'legacy', :w, '2026-01-01')",
            w=label,
        )
    ledger_time_at(monkeypatch, W45_CLOSED)
    assert ledger.reset_closed() == {"2026-w45": 1}
    with pytest.raises(LedgerError, match="is open, it has not closed"):
        ledger.reset("9999-12-31")
    with pytest.raises(LedgerError, match="not a calendar window"):
        ledger.reset("campaign-q3")


def test_verify_reports_a_seal_or_a_rescope_undone_in_sql(ledger_url, ledger, monkeypatch):
    ledger.spend(key_for("alice", "heatmap", "2026-w45"), RELEASE)
    ledger_time_at(monkeypatch, W45_CLOSED)
    ledger.reset("2026-w45")
    snap, traj = key_for("bob", "snapshot", "2026-w46"), key_for("bob", "trajectory", "2026-w46")
    ledger.spend(snap, RELEASE)
    ledger.rescope(snap, traj, reason="re-scored")
    assert ledger.verify().ok
    execute(ledger_url, "UPDATE dp_windows SET sealed_at = NULL")
    execute(ledger_url, "UPDATE dp_accounts SET rescoped_to = NULL")
    problems = ledger.verify().problems
    assert any("2026-w45" in p and "sealed_at None differs" in p for p in problems), problems
    assert any("bob/snapshot" in p and "rescoped_to differs" in p for p in problems), problems
    execute(ledger_url, "DELETE FROM dp_windows")
    assert any("charged but has no row" in p for p in ledger.verify().problems)


# ---------------------------------------------------------------- rescope only re-classifies


@pytest.mark.parametrize(
    "target",
    [
        key_for("mallory", "trajectory", "2026-w45"),  # another subject
        key_for("alice", "trajectory", "2026-w46"),  # another window
        key_for("alice", "trajectory", "2026-w45", tenant="other"),  # another tenant
        key_for("alice", "heatmap", "2026-w45"),  # the same key
    ],
)
def test_rescope_moves_no_spend_onto_another_subject_window_or_tenant(ledger_url, ledger, target):
    ledger.spend(key_for("alice", "heatmap", "2026-w45"), RELEASE)
    before = snapshot(ledger_url)
    with pytest.raises(ValueError):
        ledger.rescope(key_for("alice", "heatmap", "2026-w45"), target)
    assert snapshot(ledger_url) == before


def test_a_rescoped_key_never_restarts_from_zero(ledger):
    old, new = key_for("alice", "heatmap", "2026-w45"), key_for("alice", "trajectory", "2026-w45")
    reached = fill(ledger, old)
    assert ledger.rescope(old, new, reason="re-scored").epsilon == pytest.approx(reached)
    with pytest.raises(WindowSealed, match="re-scoped"):
        ledger.spend(old, RELEASE)
    with pytest.raises(BudgetExhausted):
        ledger.spend(new, RELEASE)
    assert [a.key for a in ledger.accounts() if a.rescoped_to == "trajectory"] == [old]


# ---------------------------------------------------------------- inputs


@pytest.mark.parametrize("actor", [123, "", "x" * 257, "ops\nadmin", "ops\u200b"])
def test_the_actor_must_be_a_short_visible_string(ledger_url, actor):
    with pytest.raises(ValueError, match="actor"):
        AdminLedger(BudgetCap(3.0, DELTA), url=ledger_url, actor=actor)


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda ledger: ledger.accounts(limit=10**30), "limit"),
        (lambda ledger: ledger.accounts(offset=-1), "offset"),
        (lambda ledger: ledger.accounts(offset=True), "offset"),
        (lambda ledger: ledger.history(after_seq=10**30), "after_seq"),
        (lambda ledger: ledger.history(limit=2.5), "limit"),
    ],
)
def test_paging_arguments_are_checked_before_any_query(sqlite_url, make_ledger, call, names):
    ledger = make_ledger(BudgetCap(3.0, DELTA), url=sqlite_url)
    with pytest.raises(ValueError, match=f"^{names} must be an integer in"):
        call(ledger)


def test_reaping_what_is_older_than_any_representable_moment_reaps_nothing(make_ledger):
    ledger = make_ledger(BudgetCap(3.0, DELTA))
    ledger.reserve(key_for("alice", "heatmap", "2026-w45"), RELEASE)
    assert ledger.reap(timedelta.max) == []
    assert len(ledger.open_reservations()) == 1


def test_a_relative_sqlite_path_is_one_ledger_wherever_it_is_opened(tmp_path, monkeypatch, caplog):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with caplog.at_level(logging.WARNING):
        first = AdminLedger(BudgetCap(3.0, DELTA), url="sqlite:///ledger.db")
    assert str(tmp_path / "a" / "ledger.db") in first.url
    assert "resolved" in caplog.text and str(tmp_path / "a" / "ledger.db") in caplog.text
    first.spend(key_for("alice", "heatmap", "2026-w45"), RELEASE)
    monkeypatch.chdir(tmp_path / "b")
    again = AdminLedger(url=f"sqlite:///{tmp_path / 'a' / 'ledger.db'}")
    assert again.epsilon_of(key_for("alice", "heatmap", "2026-w45")) > 0
    first.close()
    again.close()


def test_counters_are_64_bit(postgres_url, make_ledger):
    make_ledger(BudgetCap(3.0, DELTA), url=postgres_url)
    types = dict(
        sa.create_engine(postgres_url)
        .connect()
        .execute(
            sa.text(
                "SELECT table_name || '.' || column_name, data_type "
                "FROM information_schema.columns WHERE (table_name, column_name) IN "
                "(('dp_accounts', 'id'), ('dp_accounts', "
                "'releases'), ('dp_reservations', 'count'), ('dp_history', 'seq'), "
                "('dp_chain_head', 'seq'))"
            )
        )
        .all()
    )
    assert set(types.values()) == {"bigint"} and len(types) == 5
    assert (
        scalar(
            postgres_url, "SELECT data_type FROM pg_sequences WHERE sequencename = 'dp_history_seq'"
        )
        == "bigint"
    )
    # The server's history numbers go past 2^31 without a hitch.
    execute(postgres_url, "SELECT setval('dp_history_seq', 3000000000)")
    execute(postgres_url, "SELECT setval('dp_accounts_id_seq', 3000000000)")
    ledger = make_ledger(url=postgres_url)
    ledger.spend(key_for("alice", "heatmap", "2026-w45"), RELEASE)
    assert ledger.history()[-1]["seq"] > 2**31


# ---------------------------------------------------------------- upgrading an existing ledger


def test_upgrade_seals_windows_an_earlier_version_reset(
    ledger_url, ledger_at, make_ledger, monkeypatch
):
    """Revision 0004 reset windows without sealing them, so late runs were charged from
    zero. Upgrading seals every window its history says was reset, keeps every account
    and keeps the history verifiable."""
    old = ledger_at(ledger_url, "0004", BudgetCap(3.0, DELTA))
    reset_key, kept_key = (
        key_for("alice", "heatmap", "2026-w45"),
        key_for("alice", "heatmap", "2026-w46"),
    )
    old.spend(reset_key, RELEASE)
    ledger_time_at(monkeypatch, W45_CLOSED)
    old.spend(kept_key, RELEASE)
    old.reset("2026-w45")  # what 0004's reset did: drop the accounts, one entry, no seal
    migrate(ledger_url, "upgrade", "head")
    upgraded = make_ledger(url=ledger_url)
    assert upgraded.verify().ok, upgraded.verify().problems
    with pytest.raises(WindowSealed):
        upgraded.spend(reset_key, RELEASE)
    assert upgraded.epsilon_of(kept_key) > 0
    upgraded.spend(kept_key, RELEASE)
    assert upgraded.verify().ok


def test_downgrade_below_0005_is_refused_over_seals(ledger_url, ledger_at):
    old = ledger_at(ledger_url, "0007", BudgetCap(3.0, DELTA))
    old.spend(key_for("alice", "heatmap", "2026-w45"), RELEASE)
    old.reset("2026-w45")  # sealed first, as revisions 0005 to 0007 reset
    with pytest.raises(RuntimeError, match="sealed"):
        migrate(ledger_url, "downgrade", "0004")
