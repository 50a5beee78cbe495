"""Caps at wider scopes: a subject's total across query types in a window, and across the
windows of a horizon, enforced in the release's one reservation. Both backends.

The per-query-type cap of these tests is 10 (never the binding one); the total across
query types is capped at 2 and the horizon of 52 weeks at 3. A Gaussian release of noise
multiplier 3 costs eps 1.27 alone, two cost 1.87, three 2.34, four 2.70, five 3.0x.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    BudgetExhausted,
    LedgerError,
    Policy,
    PrivacyBudgetLedger,
    WindowSealed,
    key_for,
)
from dp_budget_provider.ledger.storage import clock as ledger_clock
from dp_budget_provider.ledger.windows.calendar import (
    WindowCalendar,
    display_window,
    window_bounds,
)
from dp_budget_provider.ledger.windows.policy import ACROSS_QUERY_TYPES, ACROSS_WINDOWS
from tests.admin import ADMIN

LEDGER_WINDOWS = ("2026-w28", "2026-w29")
W28, W29 = LEDGER_WINDOWS
HORIZON = "2025-w43+52"  # the 52 ISO weeks from 2025-w43: both weeks lie in it
UTC = timezone.utc
# Two fit a cap of 2 checked at its own order (1.73), a third does not (2.14).
RELEASE = GaussianMechanism(3.5)


def own(subject: str, query_type: str, window: str = W28, tenant: str = "acme"):
    return key_for(subject, query_type, window, tenant=tenant)


def across_types(subject: str, window: str = W28, tenant: str = "acme"):
    return key_for(subject, ACROSS_QUERY_TYPES, window, tenant=tenant)


def across_windows(subject: str, tenant: str = "acme"):
    return key_for(subject, ACROSS_WINDOWS, HORIZON, tenant=tenant)


def history_length(ledger: PrivacyBudgetLedger) -> int:
    with ledger.reading() as connection:
        return connection.execute(sa.text("SELECT count(*) FROM dp_history")).scalar_one()


@pytest.fixture
def scoped(ledger_url, make_ledger):
    """acme: per query type 10, across query types 2, across 52 weeks 3."""
    ledger = make_ledger(BudgetCap(10.0, 1e-5), url=ledger_url, admin=ADMIN)
    ledger.set_policy(Policy(2.0, tenant="acme", across="query_types"))
    ledger.set_policy(Policy(3.0, tenant="acme", across="windows", horizon_windows=52))
    return ledger


# ------------------------------------------------------------------ policies and calendars


def test_the_suggested_spelling_makes_the_scope_policies():
    window_total = Policy(tenant="acme", across="query_types", cap_epsilon=4.0)
    horizon = Policy(tenant="acme", across="windows", horizon_windows=52, cap_epsilon=12.0)
    assert window_total.scope == ("acme", ACROSS_QUERY_TYPES)
    assert window_total.calendar == WindowCalendar("iso_week")
    assert horizon.scope == ("acme", ACROSS_WINDOWS)
    assert horizon.calendar == WindowCalendar("iso_week", None, 52)
    assert horizon.as_record()["calendar_span"] == 52
    assert "calendar_span" not in window_total.as_record()  # old records sign as they did
    # Read back from its stored query type and calendar, it is the same policy.
    assert Policy(12.0, tenant="acme", query_type=ACROSS_WINDOWS, calendar=horizon.calendar) == (
        horizon
    )
    month_year = Policy(5.0, across="windows", horizon_windows=12, calendar=WindowCalendar("month"))
    assert month_year.calendar.window_of(datetime(2026, 7, 8, tzinfo=UTC)) == "2026-01+12"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"across": "windows"}, "needs horizon_windows"),
        ({"across": "windows", "horizon_windows": 1}, "needs horizon_windows"),
        ({"across": "windows", "horizon_windows": True}, "needs horizon_windows"),
        ({"across": "tenants"}, "across must be one of"),
        ({"across": "query_types", "query_type": "heatmap"}, "give no query_type"),
        ({"horizon_windows": 52}, "across='windows'"),
        ({"across": "query_types", "horizon_windows": 4}, "across='windows'"),
        (
            {"across": "windows", "horizon_windows": 4, "calendar": WindowCalendar("day", None, 5)},
            "spans 5 windows",
        ),
        ({"calendar": WindowCalendar("day", None, 5)}, "across='windows'"),
    ],
)
def test_a_scope_policy_spelled_wrong_is_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        Policy(1.0, **arguments)


_KINDS = st.sampled_from(
    [("iso_week", None), ("month", None), ("day", None), ("fixed", 3600), ("fixed", 86400 * 3)]
)


@given(
    kind=_KINDS,
    span=st.integers(2, 60),
    moment=st.datetimes(
        min_value=datetime(1960, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)
    ),
)
def test_a_horizon_is_whole_consecutive_windows_and_each_window_lies_in_one(kind, span, moment):
    windows = WindowCalendar(*kind)
    horizon = WindowCalendar(*kind, span)
    label = horizon.window_of(moment)
    start, end = window_bounds(label)
    assert start <= moment < end
    assert horizon.is_canonical(label)
    # Made of exactly ``span`` whole windows, and the next period starts where it ends.
    assert len(windows.windows_overlapping(start, end)) == span
    assert windows.window_of(start) == label.rsplit("+", 1)[0]
    assert horizon.window_of(end) != label and window_bounds(horizon.window_of(end))[0] == end
    # The window of the moment lies wholly inside the period.
    window_start, window_end = window_bounds(windows.window_of(moment))
    assert start <= window_start and window_end <= end


def test_a_moment_before_1970_lies_in_the_fixed_window_it_is_in():
    """Seconds are rounded down, never toward zero: 1969-01-01 01:59:59.000001 lies in the
    hour from 01:00 (found by the property above)."""
    moment = datetime(1969, 1, 1, 1, 59, 59, 1, tzinfo=UTC)
    assert WindowCalendar("fixed", 3600).window_of(moment) == "1969-01-01t01:00:00z+3600s"
    assert WindowCalendar("fixed", 3600, 2).window_of(moment) == "1969-01-01t00:00:00z+3600s+2"


def test_horizon_labels_are_canonical_only_in_their_own_form():
    horizon = WindowCalendar("iso_week", None, 52)
    assert horizon.is_canonical(HORIZON)
    assert not horizon.is_canonical("2025-w44+52")  # not where a period starts
    assert not horizon.is_canonical("2025-w43+052")
    assert not WindowCalendar("iso_week").is_canonical(HORIZON)
    assert display_window("2026-11-30t00:00:00z+3600s+4") == "2026-11-30T00:00:00Z+3600s+4"
    with pytest.raises(ValueError, match="not a calendar window"):
        window_bounds("2025-w43+1")


# ------------------------------------------------------------------ the caps, enforced


def test_a_subjects_total_across_query_types_is_capped_in_one_reservation(scoped):
    scoped.spend(own("alice", "heatmap"), RELEASE)
    scoped.spend(own("alice", "counts"), RELEASE)
    before = history_length(scoped)
    with pytest.raises(BudgetExhausted) as refused:
        scoped.reserve([own("alice", "trajectory"), own("bob", "trajectory")], RELEASE)
    assert refused.value.cap_epsilon == 2.0
    # Refused: nothing written, not even bob's share or a window row.
    assert history_length(scoped) == before
    assert scoped.epsilon_of(own("bob", "trajectory")) == 0.0
    assert scoped.epsilon_of(own("alice", "heatmap")) == pytest.approx(1.0726, abs=1e-4)
    assert scoped.epsilon_of(across_types("alice")) == pytest.approx(1.5725, abs=1e-4)
    scoped.spend(own("bob", "trajectory"), RELEASE)  # bob's own total is untouched
    assert scoped.verify().ok


def test_a_subjects_total_across_the_windows_of_a_horizon_is_capped(scoped):
    scoped.set_policy(Policy(2.3, tenant="acme", across="windows", horizon_windows=52))
    # Checked at cap 2.3's order: 2.17 for four, 2.46 for five (1.85 for three, at 2's).
    release = GaussianMechanism(4.0)
    for query_type in ("heatmap", "counts", "maps"):
        scoped.spend(own("carol", query_type, W28), release)
    scoped.spend(own("carol", "heatmap", W29), release)
    horizon = scoped.epsilon_of(across_windows("carol"))
    assert horizon == pytest.approx(1.993, abs=1e-3)
    # A second release in week 29 fits the week's total but not the horizon's.
    check = scoped.budget_check(own("carol", "counts", W29), release)
    assert check.exceeds and check.key.query_type == ACROSS_WINDOWS
    with pytest.raises(BudgetExhausted) as refused:
        scoped.spend(own("carol", "counts", W29), release)
    assert refused.value.cap_epsilon == 2.3
    assert scoped.epsilon_of(across_windows("carol")) == horizon
    assert scoped.epsilon_of(across_types("carol", W29)) == pytest.approx(0.926, abs=1e-3)
    assert scoped.verify().ok


def test_a_release_over_two_windows_of_one_horizon_charges_the_horizon_once(scoped):
    both = [own("dana", "heatmap", W28), own("dana", "heatmap", W29)]
    scoped.commit(scoped.reserve(both, RELEASE))
    alone = scoped.epsilon_alone(RELEASE)
    assert scoped.epsilon_of(across_types("dana", W28)) == pytest.approx(alone)
    assert scoped.epsilon_of(across_types("dana", W29)) == pytest.approx(alone)
    assert scoped.epsilon_of(across_windows("dana")) == pytest.approx(alone)


def test_a_cap_for_every_tenant_applies_to_each_tenant_without_its_own(ledger_url, make_ledger):
    ledger = make_ledger(BudgetCap(10.0, 1e-5), url=ledger_url, admin=ADMIN)
    ledger.set_policy(Policy(2.0, tenant="*", across="query_types"))
    ledger.set_policy(Policy(9.0, tenant="acme", across="query_types"))
    for tenant, refused in (("beta", True), ("acme", False)):
        for query_type in ("heatmap", "counts"):
            ledger.spend(own("erin", query_type, tenant=tenant), RELEASE)
        if refused:
            with pytest.raises(BudgetExhausted):
                ledger.spend(own("erin", "trajectory", tenant=tenant), RELEASE)
        else:
            ledger.spend(own("erin", "trajectory", tenant=tenant), RELEASE)
    # Without any policy across windows, no horizon account is kept.
    with ledger.reading() as connection:
        kept = connection.execute(
            sa.text("SELECT count(*) FROM dp_accounts WHERE query_type = :q"),
            {"q": ACROSS_WINDOWS},
        ).scalar_one()
    assert kept == 0


def test_a_cohort_release_costs_one_row_per_class_per_scope(scoped):
    everyone = scoped.cohort([f"u{i:04d}" for i in range(1000)], tenant="acme")
    north = scoped.cohort([f"u{i:04d}" for i in range(400)], tenant="acme")

    def rows() -> dict[str, int]:
        with scoped.reading() as connection:
            found = connection.execute(
                sa.text("SELECT query_type, count(*) FROM dp_accounts GROUP BY query_type")
            ).all()
        return dict(found)

    scoped.commit(scoped.reserve(everyone.in_window("heatmap", W28), RELEASE))
    assert rows() == {"heatmap": 1, ACROSS_QUERY_TYPES: 1, ACROSS_WINDOWS: 1}
    scoped.commit(scoped.reserve(north.in_window("counts", W29), RELEASE))
    assert rows() == {"heatmap": 1, "counts": 1, ACROSS_QUERY_TYPES: 2, ACROSS_WINDOWS: 2}
    scoped.commit(scoped.reserve(north.in_window("counts", W29), GaussianMechanism(20.0)))
    assert rows() == {"heatmap": 1, "counts": 1, ACROSS_QUERY_TYPES: 2, ACROSS_WINDOWS: 2}
    # Exact per subject: the horizon holds what covered each one, across both weeks.
    north_week = scoped.epsilon_of(across_types("u0001", W29))
    assert scoped.epsilon_of(across_windows("u0001")) > north_week > 0
    assert scoped.epsilon_of(across_types("u0900", W29)) == 0.0
    assert scoped.epsilon_of(across_windows("u0900")) == pytest.approx(
        scoped.epsilon_alone(RELEASE)
    )
    assert scoped.verify().ok


def test_the_budget_check_and_the_gate_count_the_wider_caps(scoped):
    scoped.spend(own("fay", "heatmap"), RELEASE)
    scoped.spend(own("fay", "counts"), RELEASE)
    check = scoped.budget_check(own("fay", "trajectory"), RELEASE)
    assert check.exceeds and check.cap_epsilon == 2.0
    assert check.key.query_type == ACROSS_QUERY_TYPES
    assert not scoped.budget_check(own("gus", "trajectory"), RELEASE).exceeds
    # What a reservation says of itself names its own windows, never a horizon's.
    reservation = scoped.reserve(own("gus", "trajectory"), RELEASE)
    assert {key.query_type for key in reservation.keys} == {
        "trajectory",
        ACROSS_QUERY_TYPES,
        ACROSS_WINDOWS,
    }
    receipts = scoped.commit(reservation)
    assert len(receipts) == 3


def test_a_policy_set_since_this_process_last_read_them_is_enforced(ledger_url, make_ledger):
    """A worker's remembered policies are stale once an administrator sets a cap across
    query types: its next release is charged to the new scope all the same."""
    admin = make_ledger(BudgetCap(10.0, 1e-5), url=ledger_url, admin=ADMIN)
    worker = make_ledger(url=ledger_url)
    worker.spend(own("hal", "heatmap"), RELEASE)  # remembers the policies without the cap
    admin.set_policy(Policy(2.0, tenant="acme", across="query_types"))
    worker.spend(own("hal", "counts"), RELEASE)
    worker.spend(own("hal", "trajectory"), RELEASE)
    with pytest.raises(BudgetExhausted):
        worker.spend(own("hal", "maps"), RELEASE)
    # The cap counts from its own first charge: the heatmap before it is not in the total.
    assert worker.epsilon_of(across_types("hal")) == pytest.approx(1.5725, abs=1e-4)
    assert worker.verify().ok


# ------------------------------------------------------------------ refusals and lifecycle


def test_a_release_may_not_name_a_scopes_own_query_type(scoped):
    for query_type in (ACROSS_QUERY_TYPES, ACROSS_WINDOWS):
        with pytest.raises(ValueError, match="total across a wider scope"):
            scoped.spend(own("ian", query_type), RELEASE)
    with pytest.raises(ValueError, match="total across a wider scope"):
        scoped.rescope(own("ian", "heatmap"), own("ian", ACROSS_QUERY_TYPES))


def test_a_query_type_with_another_calendar_is_refused_a_release(scoped):
    scoped.set_policy(
        Policy(10.0, tenant="acme", query_type="monthly", calendar=WindowCalendar("month"))
    )
    with pytest.raises(LedgerError, match="same calendar"):
        scoped.spend(own("jan", "monthly", "2026-07"), RELEASE)
    assert scoped.epsilon_of(own("jan", "monthly", "2026-07")) == 0.0


def test_a_sealed_window_is_sealed_for_every_query_type_and_keeps_the_horizon(scoped, monkeypatch):
    scoped.spend(own("kim", "heatmap"), RELEASE)
    horizon = scoped.epsilon_of(across_windows("kim"))
    monkeypatch.setattr(ledger_clock, "now", lambda: datetime(2026, 7, 25, tzinfo=UTC))
    scoped.reset(W28)
    # A query type never charged in the week is refused there: its total is sealed.
    with pytest.raises(WindowSealed):
        scoped.correct(own("kim", "rescoring"), RELEASE, reason="late")
    assert scoped.epsilon_of(across_windows("kim")) == horizon
    assert scoped.epsilon_of(across_types("kim")) == pytest.approx(scoped.epsilon_alone(RELEASE))
    assert scoped.verify().ok


def test_a_rescope_carries_spend_and_leaves_the_totals_alone(scoped):
    scoped.spend(own("lee", "snapshot"), RELEASE)
    totals = (scoped.epsilon_of(across_types("lee")), scoped.epsilon_of(across_windows("lee")))
    scoped.rescope(own("lee", "snapshot"), own("lee", "trajectory"), reason="re-scored")
    assert scoped.epsilon_of(own("lee", "trajectory")) == pytest.approx(totals[0])
    assert (
        scoped.epsilon_of(across_types("lee")),
        scoped.epsilon_of(across_windows("lee")),
    ) == totals
    assert scoped.verify().ok


def test_a_correction_is_charged_to_the_totals_too(scoped):
    receipt = scoped.correct(own("mo", "heatmap"), RELEASE, reason="a missed release")
    assert receipt.key.query_type == "heatmap"
    alone = scoped.epsilon_alone(RELEASE)
    assert scoped.epsilon_of(across_types("mo")) == pytest.approx(alone)
    assert scoped.epsilon_of(across_windows("mo")) == pytest.approx(alone)
    report = scoped.verify()
    assert report.ok, report.problems


def test_scope_policies_survive_reopening_and_replay(scoped, ledger_url):
    scoped.spend(own("ned", "heatmap"), RELEASE)
    reopened = PrivacyBudgetLedger(url=ledger_url)
    try:
        assert {p.scope: p for p in reopened.policies()} == {p.scope: p for p in scoped.policies()}
        horizon = reopened.policy_for_scope("acme", ACROSS_WINDOWS)
        assert horizon.horizon_windows == 52 and horizon.across == "windows"
        assert reopened.verify().ok
    finally:
        reopened.close()


def test_the_horizons_grace_runs_from_its_own_end(scoped, monkeypatch):
    """A horizon's account is sealed by the reset of its own label, once all 52 weeks and
    its grace have passed; a week's reset leaves it live."""
    scoped.spend(own("ola", "heatmap"), RELEASE)
    end = window_bounds(HORIZON)[1]
    monkeypatch.setattr(ledger_clock, "now", lambda: end + timedelta(days=4))
    scoped.reset(W28)
    scoped.reset(W29)
    assert scoped.reset(HORIZON) == 1
    with pytest.raises(WindowSealed):
        scoped.correct(own("ola", "heatmap", "2026-w30"), RELEASE, reason="late")


def test_verify_names_a_release_that_skipped_a_total_a_cap_applied_to(scoped, ledger_url):
    """Code that charges only the query type's own accounts (a worker of an older release,
    or code that bypasses the scopes) is named by verify, which replays the policies."""
    from dp_budget_provider.ledger.windows import scopes

    original = scopes.with_wider_scopes
    try:
        scopes.with_wider_scopes = lambda keys, cohorts, policies, **_: (list(keys), list(cohorts))
        scoped.spend(own("pia", "heatmap"), RELEASE)
    finally:
        scopes.with_wider_scopes = original
    report = scoped.verify()
    assert not report.ok
    assert any(
        "not charged to its subjects' total '*across query types' in 2026-w28" in problem
        for problem in report.problems
    ), report.problems
    assert any("'*across windows' in 2025-w43+52" in p for p in report.problems)


def test_a_correction_links_its_entries_on_one_chain_in_order(scoped, monkeypatch):
    """A correction appends one entry per account in one transaction; on PostgreSQL the
    heads move with the commit, so entries on a chain the transaction already moved must
    link to that move. Every entry on one chain makes each correction do so."""
    from dp_budget_provider.ledger.storage import history

    monkeypatch.setattr(history, "chain_of", lambda key, chains: 1)
    for subject in ("quin", "rae"):
        scoped.correct(own(subject, "heatmap"), RELEASE, reason="a missed release")
    report = scoped.verify()
    assert report.ok, report.problems


def test_the_report_states_a_guarantee_per_capped_scope(scoped):
    from dp_budget_provider.ledger.views import report

    unit = report.build_report(scoped)["privacy_unit"]
    assert [scope["query_type"] for scope in unit["capped_scopes"]] == [
        ACROSS_QUERY_TYPES,
        ACROSS_WINDOWS,
    ]
    assert (
        "each subject's total over all query types in each iso_week window" in (unit["statement"])
    )
    assert "horizon of 52 consecutive iso_week windows" in unit["statement"]
    assert "under another query type" not in unit["statement"]
    assert "under another tenant" in unit["statement"]
    # Another tenant's report is not covered by acme's caps.
    other = report.build_report(scoped, tenant="beta")["privacy_unit"]
    assert other["capped_scopes"] == [] and "under another query type" in other["statement"]


def test_a_release_over_two_query_types_charges_each_subjects_total_once(scoped):
    """Keys of two query types with other subjects in one release: each subject's total is
    charged once (it is one release), and verify accepts the union it holds."""
    keys = [own("sam", "heatmap"), own("tia", "heatmap"), own("sam", "counts")]
    scoped.commit(scoped.reserve(keys, RELEASE))
    alone = scoped.epsilon_alone(RELEASE)
    assert scoped.epsilon_of(across_types("sam")) == pytest.approx(alone)
    assert scoped.epsilon_of(across_types("tia")) == pytest.approx(alone)
    report = scoped.verify()
    assert report.ok, report.problems


def test_verify_names_a_total_charged_to_other_subjects(scoped):
    """Code that charges a horizon's total to someone else (a decoy of the same number)
    than the release covers is named: the total must be the release's own cohort."""
    from dp_budget_provider.ledger.windows import scopes

    original = scopes.with_wider_scopes

    def decoy(keys, cohorts, policies, **kw):
        keys, cohorts = original(keys, cohorts, policies, **kw)
        return [
            dataclasses.replace(key, subject="decoy") if key.query_type == ACROSS_WINDOWS else key
            for key in keys
        ], cohorts

    try:
        scopes.with_wider_scopes = decoy
        scoped.spend(own("uma", "heatmap"), RELEASE)
    finally:
        scopes.with_wider_scopes = original
    report = scoped.verify()
    assert any("'*across windows' in 2025-w43+52" in p for p in report.problems), report.problems


def test_a_filter_order_off_the_grid_is_refused(scoped):
    with pytest.raises(ValueError, match="not an order of the ledger's grid"):
        scoped.set_policy(Policy(1.0, tenant="acme", query_type="maps", filter_order=2.37))
    scoped.set_policy(Policy(1.0, tenant="acme", query_type="maps", filter_order=2.5))


def test_verify_names_a_correction_that_skipped_a_total(scoped):
    """A correction whose code skipped the totals is named by verify: its own entry names
    the totals it charged, and the policies replayed say which it had to."""
    from dp_budget_provider.ledger.windows import scopes

    original = scopes.with_wider_scopes
    try:
        scopes.with_wider_scopes = lambda keys, cohorts, policies, **_: (list(keys), list(cohorts))
        scoped.correct(own("val", "heatmap"), RELEASE, reason="a missed release")
    finally:
        scopes.with_wider_scopes = original
    report = scoped.verify()
    assert any(
        "does not charge its subject's total '*across query types'" in problem
        for problem in report.problems
    ), report.problems


def test_verify_names_a_corrections_total_charged_in_another_period():
    """A total's entry must lie in the period of the corrected window, not merely name the
    same subject, cost, count and reason."""
    from dp_budget_provider.ledger.storage.entries import ChargedCohort
    from dp_budget_provider.ledger.windows import scopes

    policies = {
        ("*", "*"): Policy(10.0),
        ("acme", ACROSS_QUERY_TYPES): Policy(2.0, tenant="acme", across="query_types"),
    }

    def cohort(query_type: str, window: str) -> ChargedCohort:
        return ChargedCohort(
            tenant="acme", query_type=query_type, window=window, cohort="c1", size=1,
            accounts=("Class-000000000001",), refined=None,
        )  # fmt: skip

    what = ("cost", 1, "missed")
    for window, found in ((W28, None), ("2019-w01", "in 2019-w01")):
        totals = scopes.CorrectedTotals()
        assert totals.own(cohort("heatmap", W28), [ACROSS_QUERY_TYPES], what, policies) == []
        problem = totals.total(cohort(ACROSS_QUERY_TYPES, window), what)
        assert problem is None if found is None else found in problem
        assert (totals.unmet() == []) is (found is None)
