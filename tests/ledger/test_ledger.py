"""Ledger semantics on SQLite and PostgreSQL: two-phase spend, idempotency, policies, audit."""

import dataclasses
from datetime import datetime, timedelta, timezone
from typing import ClassVar

import numpy as np
import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_budget_provider.accounting import (
    GaussianMechanism,
    LaplaceMechanism,
    Mechanism,
    PoissonSubsampledGaussianMechanism,
    PureDPMechanism,
    RDPAccountant,
    ZCDPMechanism,
)
from dp_budget_provider.ledger import (
    AttemptReused,
    BudgetCap,
    BudgetExhausted,
    LedgerConfigMismatch,
    LedgerCorrupt,
    LedgerError,
    LedgerSchemaError,
    Policy,
    ReservationStateError,
    WindowCalendar,
    key_for,
)
from dp_budget_provider.ledger.storage import clock as ledger_clock
from tests.admin import AdminLedger
from tests.ledger.checked import checked_epsilon
from tests.ledger_time import ledger_time_in

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

UTC = timezone.utc
DELTA = 1e-5
LEDGER_WINDOWS = ("2026-w28",)
KEY = key_for("alice", "heatmap", "2026-w28")


@pytest.fixture
def ledger(ledger_url):
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=ledger_url)
    yield ledger
    ledger.close()


def snapshot(ledger_url):
    """Every table's rows, to prove that a refused or failed call wrote nothing."""
    engine = sa.create_engine(ledger_url)
    tables = [
        "dp_accounts",
        "dp_reservations",
        "dp_reservation_keys",
        "dp_history",
        "dp_chain_head",
    ]
    with engine.connect() as connection:
        state = {
            t: sorted(map(tuple, connection.execute(sa.text(f"SELECT * FROM {t}")))) for t in tables
        }
    engine.dispose()
    return state


def execute(ledger_url, statement, **params):
    engine = sa.create_engine(ledger_url)
    with engine.begin() as connection:
        connection.execute(sa.text(statement), params)
    engine.dispose()


# -------------------------------------------------------------- one accounting, one number

MECHANISMS = [
    GaussianMechanism(3.0),
    LaplaceMechanism(0.2),
    PureDPMechanism(0.1),
    ZCDPMechanism(0.01),
    PoissonSubsampledGaussianMechanism(1.1, 0.01),
]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MECHANISMS), st.integers(1, 5)), min_size=1, max_size=6))
def test_ledger_reports_exactly_what_the_accountant_reports(releases):
    ledger = AdminLedger(BudgetCap(1e6, DELTA))
    reference = RDPAccountant()
    for mechanism, count in releases:
        ledger.spend(KEY, mechanism, count)
        reference.compose(mechanism, count)
    assert ledger.epsilon_of(KEY) == pytest.approx(reference.get_epsilon(DELTA)[0], rel=1e-12)
    assert ledger.receipt(KEY).method == reference.epsilon_bound(DELTA).method
    ledger.close()


def test_gaussian_only_accounts_report_the_exact_gaussian_bound(ledger):
    for _ in range(3):
        ledger.spend(KEY, GaussianMechanism(4.0))
    assert ledger.receipt(KEY).method == "analytic-gaussian"
    ledger.spend(KEY, LaplaceMechanism(0.01))
    assert ledger.receipt(KEY).method == "rdp-improved"


# -------------------------------------------------------------- two-phase spend


def test_reservations_count_in_the_prospective_check(ledger):
    release = GaussianMechanism(1.8)  # eps 2.24 alone: two (3.32) do not fit under 3.0
    first = ledger.reserve([KEY], release, attempt="a1")
    assert first.prospective_epsilon == pytest.approx(
        ledger.prospective_epsilon(key_for("x", "q", "2026-w28"), release)
    )
    assert ledger.epsilon_of(KEY) == 0.0  # not committed yet
    assert ledger.would_exceed(KEY, release)
    with pytest.raises(BudgetExhausted):
        ledger.reserve([KEY], release, attempt="a2")
    ledger.release(first, reason="task skipped before touching data")
    second = ledger.reserve([KEY], release, attempt="a3")
    receipts = ledger.commit(second)
    assert receipts[0].epsilon == pytest.approx(first.prospective_epsilon)
    assert ledger.verify().ok


def test_commit_is_idempotent_and_an_attempt_reserves_once(ledger_url, ledger):
    reservation = ledger.reserve([KEY], GaussianMechanism(4.0), attempt="dag/task/run/-1/1")
    once = ledger.commit(reservation)
    twice = ledger.commit(reservation)
    assert once == twice
    assert len([e for e in ledger.history() if e["action"] == "commit"]) == 1
    # A committed attempt never authorises another release, same or different.
    before = snapshot(ledger_url)
    for mechanism in (GaussianMechanism(4.0), GaussianMechanism(3.0)):
        with pytest.raises(ReservationStateError, match="already reserved.*committed"):
            ledger.reserve([KEY], mechanism, attempt="dag/task/run/-1/1")
    assert snapshot(ledger_url) == before
    with pytest.raises(ReservationStateError, match="cannot be released"):
        ledger.release(reservation)


def test_an_open_attempt_cannot_reserve_again(ledger):
    held = ledger.reserve([KEY], GaussianMechanism(8.0), attempt="d/t/r/-1/1/uuid")
    with pytest.raises(AttemptReused, match="already reserved.*open") as reused:
        ledger.reserve([KEY], GaussianMechanism(8.0), attempt="d/t/r/-1/1/uuid")
    # A named outcome: which attempt, its reservation and that reservation's state.
    assert (reused.value.attempt_id, reused.value.reservation_id, reused.value.state) == (
        "d/t/r/-1/1/uuid",
        held.id,
        "open",
    )
    assert isinstance(reused.value, ReservationStateError)
    assert len(ledger.open_reservations()) == 1
    ledger.commit(held)


def test_only_the_reserving_attempt_may_commit_or_release(ledger):
    """Ids are visible in the UI, XCom and history: an id (or a Reservation read back
    from the ledger) voids nothing. Only the token reserve() handed out does."""
    held = ledger.reserve([KEY], GaussianMechanism(4.0), attempt="victim")
    for call in (ledger.commit, ledger.release):
        with pytest.raises(ValueError, match="takes the Reservation"):
            call(held.id)
    seen = ledger.open_reservations()[0]  # what anyone reading the ledger gets
    assert seen.id == held.id and seen.token == ""
    forged = dataclasses.replace(held, token="guessed")
    for call in (ledger.commit, ledger.release, ledger.commit):
        for impostor in (seen, forged):
            with pytest.raises(ReservationStateError, match="only the attempt that reserved"):
                call(impostor)
    assert ledger.open_reservations()[0].id == held.id  # still open and counted
    assert ledger.commit(held)[0].epsilon > 0
    assert ledger.verify().ok


def test_a_retry_is_a_new_attempt_and_is_charged_again(ledger):
    for try_number in (1, 2, 3):
        ledger.commit(
            ledger.reserve([KEY], GaussianMechanism(8.0), attempt=f"d/t/r/-1/{try_number}")
        )
    reference = RDPAccountant()
    reference.compose(GaussianMechanism(8.0), 3)
    assert ledger.epsilon_of(KEY) == pytest.approx(reference.get_epsilon(DELTA)[0], rel=1e-12)


def test_released_reservations_cannot_be_committed(ledger):
    reservation = ledger.reserve([KEY], GaussianMechanism(4.0))
    ledger.release(reservation)
    ledger.release(reservation)  # releasing twice is harmless
    with pytest.raises(ReservationStateError, match="cannot be committed"):
        ledger.commit(reservation)
    assert ledger.epsilon_of(KEY) == 0.0
    with pytest.raises(ReservationStateError, match="no reservation"):
        ledger.commit(dataclasses.replace(reservation, id="00000000-0000-0000-0000-000000000000"))


def test_multi_key_reservation_is_all_or_nothing(ledger_url, ledger):
    subjects = [key_for(f"subject-{i:03d}", "heatmap", "2026-w28") for i in range(120)]
    heavy = subjects[77]
    ledger.spend(heavy, GaussianMechanism(1.8))  # leaves too little for the next release
    before = snapshot(ledger_url)
    with pytest.raises(BudgetExhausted) as excinfo:
        ledger.reserve(subjects, GaussianMechanism(2.0))
    assert excinfo.value.key == heavy
    assert snapshot(ledger_url) == before
    others = [k for k in subjects if k != heavy]
    receipts = ledger.commit(ledger.reserve(others, GaussianMechanism(2.0)))
    # One receipt per account: the 119 subjects charged together form one class.
    assert [r.subjects for r in receipts] == [len(others)]
    assert {ledger.epsilon_of(k) for k in others} == {receipts[0].epsilon}
    assert ledger.epsilon_of(others[0]) == receipts[0].epsilon
    assert ledger.verify().ok


def test_reap_charges_abandoned_reservations_and_never_refunds(ledger):
    reservation = ledger.reserve([KEY], GaussianMechanism(4.0))
    assert ledger.reap(timedelta(hours=1)) == []  # too young
    later = datetime.now(UTC) + timedelta(hours=2)
    assert ledger.reap(timedelta(hours=1), now=later) == [reservation.id]
    assert ledger.epsilon_of(KEY) == pytest.approx(reservation.prospective_epsilon)
    entry = [e for e in ledger.history() if e["action"] == "reap"][0]
    assert "lease ran out at" in entry["payload"]["reason"]
    assert entry["payload"]["lease_expires_at"] == reservation.lease_expires_at
    assert ledger.open_reservations() == []
    assert ledger.commit(reservation)[0].epsilon == pytest.approx(reservation.prospective_epsilon)
    assert ledger.verify().ok


# -------------------------------------------------------------- configuration is fixed


def test_reopening_with_another_delta_grid_conversion_or_cap_is_refused(ledger_url, ledger):
    ledger.spend(KEY, GaussianMechanism(4.0))
    with pytest.raises(LedgerConfigMismatch, match="delta"):
        AdminLedger(BudgetCap(3.0, 1e-6), url=ledger_url)
    with pytest.raises(LedgerConfigMismatch, match="grid"):
        AdminLedger(BudgetCap(3.0, DELTA), url=ledger_url, orders=[2.0, 4.0, 8.0])
    with pytest.raises(LedgerConfigMismatch, match="conversion"):
        AdminLedger(BudgetCap(3.0, DELTA), url=ledger_url, conversion="classic")
    with pytest.raises(LedgerConfigMismatch, match="set_policy"):
        AdminLedger(BudgetCap(30.0, DELTA), url=ledger_url)
    reopened = AdminLedger(url=ledger_url)
    assert reopened.epsilon_of(KEY) == ledger.epsilon_of(KEY)
    assert reopened.delta == DELTA
    reopened.close()


def test_a_new_ledger_needs_a_cap(ledger_url):
    with pytest.raises(LedgerConfigMismatch, match="needs a BudgetCap"):
        AdminLedger(url=ledger_url)


def test_unknown_schema_version_is_refused(ledger_url, ledger):
    execute(ledger_url, "UPDATE dp_budget_alembic_version SET version_num = '9999'")
    with pytest.raises(LedgerSchemaError, match="9999"):
        AdminLedger(url=ledger_url)


def test_a_dropped_policy_version_trigger_is_found_by_verify(postgres_url):
    """Without its trigger, a policy edit would not reach processes reusing policies by
    version (a lowered cap unseen): verify names the missing trigger."""
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=postgres_url)
    ledger.spend(KEY, GaussianMechanism(4.0))
    assert ledger.verify().ok
    execute(postgres_url, "DROP TRIGGER dp_policies_version ON dp_policies")
    report = ledger.verify(quarantine=False)
    assert any("dp_policies_version" in problem for problem in report.problems)
    ledger.close()


def test_nan_in_a_stored_curve_fails_closed(ledger_url, ledger):
    ledger.spend(KEY, LaplaceMechanism(0.3))
    execute(
        ledger_url, "UPDATE dp_accounts SET residual = :r", r="[" + ",".join(["NaN"] * 156) + "]"
    )
    before = snapshot(ledger_url)
    with pytest.raises(LedgerCorrupt, match="NaN"):
        ledger.spend(KEY, GaussianMechanism(4.0))
    with pytest.raises(LedgerCorrupt):
        ledger.epsilon_of(KEY)
    assert snapshot(ledger_url) == before


# -------------------------------------------------------------- bad input never reaches the DB


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (
            lambda led: led.spend(KEY, {"kind": "gaussian", "noise_multiplier": float("nan")}),
            ValueError,
        ),
        (lambda led: led.spend(KEY, {"kind": "quantum", "noise_multiplier": 1.0}), ValueError),
        (lambda led: led.spend(KEY, {"kind": "laplace", "epsilon0": -1}), ValueError),
        (lambda led: led.spend(KEY, GaussianMechanism(1.0), count=0), ValueError),
        (lambda led: led.spend(KEY, GaussianMechanism(1.0), count=1.5), ValueError),
        (lambda led: led.spend("alice/heatmap/2026-w28", GaussianMechanism(1.0)), ValueError),
        (lambda led: led.spend(KEY, "gaussian"), ValueError),
        (lambda led: led.reserve([], GaussianMechanism(1.0)), ValueError),
        (lambda led: led.reserve([KEY, KEY], GaussianMechanism(1.0)), ValueError),
        (lambda led: led.reserve([KEY], GaussianMechanism(1.0), attempt=""), ValueError),
        (lambda led: led.reserve([KEY], GaussianMechanism(1.0), attempt="x" * 2000), ValueError),
        (lambda led: led.rescope(KEY, key_for("alice", "heatmap", "2026-w29")), ValueError),
        (lambda led: led.correct(KEY, GaussianMechanism(1.0), reason=""), ValueError),
        (lambda led: led.reap(timedelta(hours=-1)), ValueError),
        (lambda led: led.reset(None), ValueError),
        (lambda led: led.set_policy({"cap_epsilon": 1.0}), ValueError),
    ],
)
def test_bad_input_raises_and_writes_nothing(ledger_url, ledger, call, error):
    before = snapshot(ledger_url)
    with pytest.raises(error):
        call(ledger)
    assert snapshot(ledger_url) == before


# -------------------------------------------------------------- windows, corrections, policies


def test_reset_refuses_open_custom_and_busy_windows(ledger, monkeypatch):
    ledger.spend(KEY, GaussianMechanism(4.0))
    monkeypatch.setattr(ledger_clock, "now", lambda: datetime(2026, 7, 10, tzinfo=UTC))
    with pytest.raises(LedgerError, match="is open, it has not closed"):
        ledger.reset("2026-w28")
    # Ended (Monday 2026-07-13) but within the default 3-day grace period.
    monkeypatch.setattr(ledger_clock, "now", lambda: datetime(2026, 7, 15, tzinfo=UTC))
    with pytest.raises(LedgerError, match="grace period"):
        ledger.reset("2026-w28")
    assert ledger.reset_closed() == {}
    with pytest.raises(LedgerError, match="calendar"):
        ledger.reset("campaign-q3")
    ledger.reserve([KEY], GaussianMechanism(4.0))  # a late run, within the grace period
    monkeypatch.setattr(ledger_clock, "now", lambda: datetime(2026, 8, 1, tzinfo=UTC))
    with pytest.raises(LedgerError, match="reap first"):
        ledger.reset("2026-W28")
    ledger.reap(timedelta(0))
    final = ledger.epsilon_of(KEY)
    assert final > 0
    assert ledger.reset_closed() == {"2026-w28": 1}
    assert ledger.epsilon_of(KEY) == final  # sealed: its final spend, never 0.0
    assert [e["action"] for e in ledger.history()][-1] == "reset"
    assert ledger.reset_closed() == {}  # sealed: nothing left to reset
    assert ledger.reset("2026-w28") == 0
    assert ledger.verify().ok


def test_corrections_add_spend_as_new_entries(ledger):
    ledger.spend(KEY, GaussianMechanism(4.0))
    before = ledger.epsilon_of(KEY)
    receipt = ledger.correct(KEY, GaussianMechanism(4.0), reason="release missed by an old DAG")
    assert receipt.epsilon > before
    entry = ledger.history(KEY)[-1]
    assert entry["action"] == "correction" and entry["payload"]["reason"].startswith("release")
    assert ledger.verify().ok


def test_policies_override_per_tenant_and_query_type(ledger):
    ledger.set_policy(
        Policy(
            1.0,
            tenant="acme",
            query_type="trajectory",
            calendar=WindowCalendar("month"),
            compliance_clause="GDPR Art. 25: at most eps 1 per subject per month",
        )
    )
    ledger.set_policy(Policy(2.0, tenant="acme"))
    strict = key_for("bob", "trajectory", "2026-07", tenant="acme")  # a month: its calendar
    loose = key_for("bob", "heatmap", "2026-w28", tenant="ACME ")
    assert ledger.policy_for(strict).cap_epsilon == 1.0
    assert ledger.policy_for(strict).compliance_clause.startswith("GDPR")
    assert ledger.policy_for(loose).cap_epsilon == 2.0
    assert ledger.policy_for(KEY).cap_epsilon == 3.0
    with pytest.raises(BudgetExhausted):
        ledger.spend(strict, GaussianMechanism(3.0))
    assert ledger.spend(loose, GaussianMechanism(3.0)).cap_epsilon == 2.0
    assert [p.scope for p in ledger.policies()][0] == ("*", "*")
    assert [e["action"] for e in ledger.history()].count("policy") == 3


# -------------------------------------------------------------- tamper evidence


@pytest.mark.parametrize(
    ("statement", "problem"),
    [
        (
            "UPDATE dp_history SET payload = replace(payload, 'count', 'kount') WHERE seq = 4",
            "edited",
        ),
        ("UPDATE dp_history SET actor = 'mallory' WHERE seq = 2", "edited"),
        ("DELETE FROM dp_history WHERE seq = 3", "missing"),
        ("DELETE FROM dp_history WHERE seq = (SELECT max(seq) FROM dp_history)", "removed"),
        ("UPDATE dp_accounts SET rho = rho / 2", "differs from the history"),
        ("UPDATE dp_accounts SET \"window\" = '2026-w30'", "no history entry charged"),
        ("DELETE FROM dp_reservation_keys", "digest"),
    ],
)
def test_verify_detects_direct_sql_tampering(ledger_url, ledger, statement, problem):
    ledger.spend(KEY, GaussianMechanism(4.0))
    ledger.spend(KEY, GaussianMechanism(4.0))
    assert ledger.verify().ok
    execute(ledger_url, statement)
    report = ledger.verify()
    assert not report.ok
    assert any(problem in p for p in report.problems), report.problems


@dataclasses.dataclass  # not frozen: unhashable, as a user's own mechanism may be
class _MutableGaussian(Mechanism):
    kind: ClassVar[str] = "test-mutable-gaussian"
    noise_multiplier: float

    def rdp(self, orders: np.ndarray) -> np.ndarray:
        return np.asarray(orders, dtype=np.float64) / (2.0 * self.noise_multiplier**2)


def test_release_costs_are_kept_per_mechanism_value_hashable_or_not(monkeypatch) -> None:
    """Costs are kept per (mechanism, count); equal mechanisms share one, an unhashable
    one is known by its spec, and every charge equals the accountant's."""
    ledger_time_in(monkeypatch, "2026-w45")
    ledger = AdminLedger(cap=BudgetCap(epsilon=100.0, delta=1e-5))
    key = key_for("cost-cache", "count", "2026-w45")
    releases = [
        (GaussianMechanism(3), 1),
        (GaussianMechanism(3.0), 1),  # equal to the first: validated to the same float
        (GaussianMechanism(3.0), 2),
        (_MutableGaussian(4.0), 1),
        (_MutableGaussian(4.0), 1),
        (_MutableGaussian(5.0), 1),
    ]
    accountant = RDPAccountant()
    for mechanism, count in releases:
        ledger.spend(key, mechanism, count=count)
        accountant.compose(mechanism, count)
    # Equal but for the ledger's sums, rounded up at each addition (rounding.ROUND_UP).
    assert ledger.epsilon_of(key) == pytest.approx(accountant.get_epsilon(1e-5)[0], rel=1e-13)
    assert len(ledger._pricing.cost_cache) == 4
    ledger.close()


# ---------------------------------------------------------------------- held spend and states


def test_accounts_show_the_spend_open_reservations_hold(ledger):
    """Nothing committed, but two open reservations hold almost all of the cap: the account
    shows that, and the state says the next such release is refused."""
    first = ledger.reserve(KEY, ZCDPMechanism(0.085), attempt="run/1")
    ledger.reserve(KEY, ZCDPMechanism(0.085), attempt="run/2")
    (status,) = ledger.accounts()
    assert status.epsilon == 0.0 and status.remaining == 3.0
    assert status.open_reservations == 2
    assert status.held_epsilon == pytest.approx(held_epsilon(ledger), rel=1e-12)
    assert 2.5 < status.held_epsilon < 3.0
    # What is left is what the cap check counts: at the cap's filter order.
    held = checked_epsilon(3.0, DELTA, (ZCDPMechanism(0.085), 2))
    assert status.remaining_after_held == pytest.approx(3.0 - held, rel=1e-12)
    assert status.state == "EXHAUSTED"  # a third is refused
    with pytest.raises(BudgetExhausted):
        ledger.reserve(KEY, ZCDPMechanism(0.085), attempt="run/3")
    ledger.release(first)
    (status,) = ledger.accounts()
    assert status.held_epsilon == pytest.approx(held_epsilon(ledger), rel=1e-12)
    assert status.state == "ok"  # one held (below the warning fraction): a second fits


def held_epsilon(ledger) -> float:
    """eps of KEY's committed and reserved spend, by the accountant the ledger hands out."""
    return ledger.prospective_accountant(KEY).epsilon_bound(DELTA).epsilon


def _capped_at_next_release(ledger, cap_offset: int):
    """Two Gaussian releases committed, then the cap set to exactly what the cap check
    counts for a third (at the scope's filter order, which a charged scope keeps), moved
    ``cap_offset`` representable doubles up or down."""
    mechanism = GaussianMechanism(4.0)
    for run in range(2):
        ledger.spend(KEY, mechanism, attempt=f"run/{run}")
    cap = ledger.budget_check(KEY, mechanism).checked_epsilon
    for _ in range(abs(cap_offset)):
        cap = float(np.nextafter(cap, np.inf if cap_offset > 0 else 0.0))
    ledger.set_policy(Policy(cap, warn_fraction=0.5))
    return mechanism


def test_exhausted_exactly_when_the_scopes_cheapest_release_no_longer_fits(ledger):
    """Below the boundary: the third release would pass the cap by one ulp, so the account
    reads EXHAUSTED and the release is refused, leaving the account as it was."""
    mechanism = _capped_at_next_release(ledger, -1)
    (status,) = ledger.accounts()
    assert status.fraction < 1.0 and status.state == "EXHAUSTED" and status.exhausted
    with pytest.raises(BudgetExhausted):
        ledger.reserve(KEY, mechanism, attempt="run/2")
    assert ledger.accounts() == [status]  # the refusal changed nothing, the state included


def test_not_exhausted_while_the_cheapest_release_still_fits(ledger):
    """At the boundary: the third release reaches the cap exactly, which is allowed, so the
    account is only WARNING; once that release is committed nothing fits any more."""
    mechanism = _capped_at_next_release(ledger, 0)
    (status,) = ledger.accounts()
    assert status.state == "WARNING" and not status.exhausted
    ledger.spend(KEY, mechanism, attempt="run/2")
    (status,) = ledger.accounts()
    assert status.state == "EXHAUSTED" and status.remaining == 0.0


def test_the_cheapest_release_of_the_scope_decides_in_every_window(ledger, monkeypatch):
    """A scope that also made a cheap release, in another window, leaves room for it:
    only the cheapest release the scope ever reserved (in any window, any outcome) counts."""
    ledger_time_in(monkeypatch, "2026-w28", "2026-w29")
    mechanism = _capped_at_next_release(ledger, -1)
    other = key_for("bob", KEY.query_type, "2026-w29")
    ledger.release(ledger.reserve(other, GaussianMechanism(40.0), attempt="cheap/1"))
    status = next(s for s in ledger.accounts() if s.key == KEY)
    assert status.state == "WARNING"
    assert not ledger.would_exceed(KEY, GaussianMechanism(40.0))
    assert ledger.would_exceed(KEY, mechanism)
    unrelated = key_for("carol", "another query", KEY.window)
    ledger.spend(unrelated, PureDPMechanism(0.01), attempt="other/1")
    assert next(s for s in ledger.accounts() if s.key == unrelated).state != "EXHAUSTED"
