"""Seed 001's invariants (a)-(g) and checklist items 1-6, in our words, against the real ledger."""

import numpy as np
import pytest

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    GaussianMechanism,
    LaplaceMechanism,
    RDPAccountant,
    advanced_composition,
    basic_composition,
    zcdp_to_dp,
)
from dp_budget_provider.ledger import (
    BudgetCap,
    BudgetExhausted,
    PrivacyBudgetLedger,
    WindowSealed,
    key_for,
)
from dp_budget_provider.ledger.windows.calendar import window_bounds
from dp_budget_provider.ledger.windows.policy import DEFAULT_GRACE
from tests.ledger.checked import checked_epsilon
from tests.ledger_time import ledger_time_at

DELTA = 1e-5
LEDGER_WINDOWS = ("2026-w28", "2026-w29")
RELEASE = GaussianMechanism(4.0)


@pytest.fixture
def ledger(ledger_url):
    ledger = PrivacyBudgetLedger(BudgetCap(3.0, DELTA, warn_fraction=0.8), url=ledger_url)
    yield ledger
    ledger.close()


def test_a_composition_is_addition_in_the_ledger(ledger):
    key = key_for("subject:9f2a", "heatmap", "2026-W28")
    for _ in range(5):
        ledger.spend(key, RELEASE)
    reference = RDPAccountant()
    reference.compose(RELEASE, 5)
    assert ledger.epsilon_of(key) == pytest.approx(reference.get_epsilon(DELTA)[0], rel=1e-12)


def test_b_classic_grid_is_tight_to_and_never_beats_the_zcdp_closed_form(ledger_url):
    ledger = PrivacyBudgetLedger(BudgetCap(50.0, DELTA), url=ledger_url, conversion="classic")
    key = key_for("s", "heatmap", "2026-w28")
    for _ in range(20):
        ledger.spend(key, RELEASE)
    closed = zcdp_to_dp(20 / 32, DELTA)
    assert ledger.epsilon_of(key) + 1e-9 >= closed
    assert ledger.epsilon_of(key) - closed < 0.10 * closed
    assert ledger.epsilon_of(key) == pytest.approx(5.989924526737262, rel=1e-12)
    ledger.close()


def test_c_rdp_is_never_looser_than_basic_composition(ledger):
    key = key_for("s", "heatmap", "2026-w28")
    for _ in range(3):
        ledger.spend(key, RELEASE)
    single = zcdp_to_dp(1 / 32, DELTA)
    assert ledger.epsilon_of(key) <= basic_composition(single, 3)
    assert basic_composition(single, 3) <= advanced_composition(single, DELTA, 3)


def test_d_laplace_curves_are_finite_and_positive_in_the_ledger(ledger):
    key = key_for("s", "counts", "2026-w28")
    receipt = ledger.spend(key, LaplaceMechanism(0.5))
    assert np.isfinite(receipt.epsilon) and receipt.epsilon > 0
    assert np.all(np.isfinite(LaplaceMechanism(0.5).rdp(DEFAULT_ORDERS)))


def test_e_cap_monotone_and_warns_before_blocking(ledger):
    # Checklist 3 and 4: never past the cap; a warned receipt precedes the first block.
    key = key_for("subject:9f2a", "heatmap", "2026-W28")
    last, warned_once, spent = 0.0, False, 0
    while not ledger.would_exceed(key, RELEASE):
        receipt = ledger.spend(key, RELEASE)
        assert receipt.epsilon >= last
        assert receipt.epsilon <= 3.0
        assert receipt.warned == (receipt.fraction >= 0.8)  # as the cap check counts
        last, warned_once, spent = receipt.epsilon, warned_once or receipt.warned, spent + 1
    assert warned_once
    # Gaussian(4) at delta 1e-5: 7 fit the filter at cap 3's order (7.5); 8 would fit the
    # reported epsilon's exact Gaussian bound, which is not a filter (docs/accounting.md).
    assert (
        spent
        == 7
        == max(k for k in range(1, 20) if checked_epsilon(3.0, DELTA, (RELEASE, k)) <= 3.0)
    )
    assert ledger.epsilon_of(key) <= 3.0


def test_f_release_past_the_cap_raises_and_changes_nothing(ledger):
    key = key_for("s", "heatmap", "2026-w28")
    while not ledger.would_exceed(key, RELEASE):
        ledger.spend(key, RELEASE)
    before_eps, before_history = ledger.epsilon_of(key), ledger.history()
    with pytest.raises(BudgetExhausted) as excinfo:
        ledger.spend(key, RELEASE)
    assert "s/heatmap/2026-w28" in str(excinfo.value)
    assert excinfo.value.cap_epsilon == 3.0 and excinfo.value.would_be_epsilon > 3.0
    with pytest.raises(BudgetExhausted):
        ledger.reserve([key], RELEASE)
    assert ledger.epsilon_of(key) == before_eps
    assert ledger.history() == before_history
    assert ledger.open_reservations() == []
    assert ledger.verify().ok


def test_g_rescope_carries_spend_and_reset_frees_only_its_window(ledger_url, monkeypatch):
    ledger = PrivacyBudgetLedger(BudgetCap(5.0, DELTA), url=ledger_url)
    snap = key_for("subject:c71b", "heatmap", "2026-W28")
    other_window = key_for("subject:c71b", "heatmap", "2026-W29")
    ledger.spend(snap, RELEASE)
    ledger.spend(other_window, RELEASE)
    spent = ledger.epsilon_of(snap)
    traj = key_for("subject:c71b", "trajectory", "2026-W28")
    receipt = ledger.rescope(snap, traj, reason="temporal frequency rose")
    # Checklist 5: unchanged at the instant of re-classification...
    assert receipt.epsilon == pytest.approx(spent, abs=1e-12)
    assert ledger.epsilon_of(traj) == pytest.approx(spent, abs=1e-12)
    # The old key keeps its record and is sealed: it can never restart from zero.
    with pytest.raises(WindowSealed, match="re-scoped to query type 'trajectory'"):
        ledger.spend(snap, RELEASE)
    # ...and later releases at trajectory sensitivity (L2 = 2) cost more than snapshot ones.
    trajectory_release = GaussianMechanism.from_sigma(sigma=4.0, l2_sensitivity=2.0)
    assert ledger.prospective_epsilon(traj, trajectory_release) > ledger.prospective_epsilon(
        traj, RELEASE
    )
    # A sealed key cannot be re-scoped again, nor re-scoped onto.
    with pytest.raises(WindowSealed):
        ledger.rescope(traj, snap)
    with pytest.raises(WindowSealed):
        ledger.rescope(snap, key_for("subject:c71b", "count", "2026-W28"))
    # Checklist 6: reset frees exactly that window (past its grace period), and seals it:
    # its accounts leave the live ones and keep their final spend (never read as zero).
    ledger_time_at(monkeypatch, window_bounds("2026-w28")[1] + DEFAULT_GRACE)
    assert ledger.reset("2026-W28") == 2
    assert ledger.epsilon_of(traj) == pytest.approx(spent, abs=1e-12)
    assert ledger.epsilon_of(snap) == pytest.approx(spent, abs=1e-12)  # frozen when re-scoped
    sealed = {s.key: s.state for s in ledger.accounts(window="2026-W28")}
    assert sealed == {snap: "RESCOPED", traj: "SEALED"}
    assert [s.key for s in ledger.accounts()] == [other_window]
    assert ledger.epsilon_of(other_window) > 0
    with pytest.raises(WindowSealed, match="sealed"):
        ledger.spend(traj, RELEASE)
    assert ledger.verify().ok
    ledger.close()
