"""Costs at the cap: the ledger refuses what the exact curves refuse, and verify opens
ledgers whose costs an earlier version priced with the curves this version corrected."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    GaussianMechanism,
    PoissonSubsampledGaussianMechanism,
    PureDPMechanism,
    gaussian_epsilon,
)
from dp_budget_provider.accounting import mechanisms as mechanisms_module
from dp_budget_provider.ledger import BudgetCap, BudgetExhausted, key_for
from tests.accounting import mp_oracles

LEDGER_WINDOWS = ("2026-w28",)
KEY = key_for("alice", "heatmap", "2026-w28")


def test_a_large_fractional_order_on_the_grid_does_not_open_the_cap(ledger_url, make_ledger):
    orders = [*DEFAULT_ORDERS.tolist(), 90.5]
    ledger = make_ledger(BudgetCap(1.0, 1e-5), url=ledger_url, orders=orders)
    with pytest.raises(BudgetExhausted):  # eps ~4.5; the order 90.5 used to give 0.0
        ledger.spend(KEY, PoissonSubsampledGaussianMechanism(10.0, 0.3), 1000)


def test_a_cap_at_the_exact_gaussian_bound_is_not_passed(ledger_url, make_ledger):
    cap = gaussian_epsilon(1e-4, 1e-10)
    ledger = make_ledger(BudgetCap(cap, 1e-10), url=ledger_url)
    try:
        ledger.spend(KEY, GaussianMechanism(1e4))
    except BudgetExhausted:
        return
    granted = ledger.epsilon_of(KEY)
    assert granted <= cap and mp_oracles.gaussian_delta(granted, 1e-4) <= 1e-10


@pytest.mark.parametrize(("z", "granted"), [(1e300, True), (1e-200, False)])
def test_extreme_noise_multipliers_are_granted_or_refused(ledger_url, make_ledger, z, granted):
    ledger = make_ledger(BudgetCap(1.0, 1e-5), url=ledger_url)
    if granted:
        ledger.spend(KEY, GaussianMechanism(z))
        assert ledger.epsilon_of(KEY) == 0.0
    else:
        with pytest.raises(BudgetExhausted):
            ledger.spend(KEY, GaussianMechanism(z))
    assert ledger.verify().ok


def _old_pure_dp_rdp(epsilon0: float, orders: np.ndarray) -> np.ndarray:
    """The curve an earlier version charged: cancelled to ~60% of exact at eps0 = 1e-8."""
    return 0.6 * mechanisms_module._pure_dp_rdp_today(epsilon0, orders)


def test_verify_notes_an_earlier_versions_pricing_and_proves_the_cap_with_todays(
    ledger_url, make_ledger, monkeypatch
):
    today = mechanisms_module._pure_dp_rdp
    monkeypatch.setattr(mechanisms_module, "_pure_dp_rdp_today", today, raising=False)
    monkeypatch.setattr(mechanisms_module, "_pure_dp_rdp", _old_pure_dp_rdp)
    ledger = make_ledger(BudgetCap(3.0, 1e-5), url=ledger_url)
    ledger.spend(KEY, PureDPMechanism(0.05), 10)  # under the cap at either price
    monkeypatch.setattr(mechanisms_module, "_pure_dp_rdp", today)
    report = ledger.verify(quarantine=False)
    assert report.ok, report.problems
    assert any("earlier version's pricing" in note for note in report.notes)


def test_a_grant_over_the_cap_at_todays_price_is_a_breach(ledger_url, make_ledger, monkeypatch):
    today = mechanisms_module._pure_dp_rdp
    monkeypatch.setattr(mechanisms_module, "_pure_dp_rdp_today", today, raising=False)
    monkeypatch.setattr(mechanisms_module, "_pure_dp_rdp", _old_pure_dp_rdp)
    ledger = make_ledger(BudgetCap(1.0, 1e-5), url=ledger_url)
    while True:  # fill to the cap at the earlier, lower price
        try:
            ledger.spend(KEY, PureDPMechanism(0.05), 10)
        except BudgetExhausted:
            break
    monkeypatch.setattr(mechanisms_module, "_pure_dp_rdp", today)
    report = ledger.verify(quarantine=False)
    assert any("above its cap" in problem for problem in report.problems)
    assert math.isfinite(ledger.epsilon_of(KEY))


def test_an_edited_gaussian_cost_is_still_a_problem(ledger_url, make_ledger, monkeypatch):
    ledger = make_ledger(BudgetCap(3.0, 1e-5), url=ledger_url)
    monkeypatch.setattr(GaussianMechanism, "zcdp_rho", property(lambda self: 1e-3))
    monkeypatch.setattr(GaussianMechanism, "mu_squared", lambda self, count: 2e-3 * count)
    ledger.spend(KEY, GaussianMechanism(2.0))
    monkeypatch.undo()
    report = ledger.verify(quarantine=False)
    assert any("not what its mechanism costs" in problem for problem in report.problems)
