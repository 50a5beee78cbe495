"""The ledger's sums are never below the exact sums of what they add (rounding.ROUND_UP).

Plain float addition rounds to nearest, so after enough additions an account's stored
spend can sit below the exact total of its charges: an eps below the true loss. Every
sum the ledger keeps is rounded up instead, in Python and in the SQL updates alike.
"""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.accounting.rounding import ROUND_UP, difference_up, sum_up
from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger, key_for
from dp_budget_provider.ledger.accounts.spend import Pending, Spend

COSTS = st.floats(min_value=1e-300, max_value=1e3, allow_nan=False, allow_infinity=False)
LEDGER_WINDOWS = ("2026-w45",)


def test_the_factor_is_exact():
    assert Fraction(ROUND_UP) == 1 + Fraction(1, 2**51)


@settings(max_examples=300, deadline=None)
@given(st.lists(COSTS, min_size=1, max_size=60))
def test_a_spend_summed_in_any_order_is_never_below_the_exact_sum(costs):
    total = Spend()
    for cost in costs:
        total = total.plus(Spend(cost, np.array([cost, 2 * cost]), cost))
    exact = sum(map(Fraction, costs), Fraction(0))
    assert Fraction(total.rho) >= exact
    assert Fraction(total.gaussian_mu2) >= exact
    assert Fraction(float(total.residual[0])) >= exact
    assert Fraction(float(total.residual[1])) >= 2 * exact


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(COSTS, st.booleans()), min_size=1, max_size=60))
def test_pending_spend_through_opens_and_closes_is_never_below_what_is_open(steps):
    """Reservations open (add) and close (subtract) in any order: the pending sum is
    always at least the exact sum of the costs still open."""
    pending, open_costs = Pending(), []
    for cost, close in steps:
        if close and open_costs:
            closing = open_costs.pop(0)
            pending = pending.remove(Spend(closing, None, closing))
        else:
            open_costs.append(cost)
            pending = pending.add(Spend(cost, None, cost))
        exact = sum(map(Fraction, open_costs), Fraction(0))
        assert Fraction(pending.rho) >= exact
        assert Fraction(pending.mu2) >= exact


def test_the_helpers_round_up_where_plain_arithmetic_rounds_down():
    a, b = 1.0, 1.5 * 2.0**-54  # plain a + b rounds to a, below the exact sum
    assert a + b == a and Fraction(a) + Fraction(b) > Fraction(a + b)
    assert Fraction(sum_up(a, b)) >= Fraction(a) + Fraction(b)
    c, d = 1.0 + 2.0**-52, 2.0**-53 * 1.5  # plain c - d rounds below the exact difference
    assert Fraction(difference_up(c, d)) >= Fraction(c) - Fraction(d)
    assert difference_up(1.0, 2.0) == 0.0


def _adversarial_releases(count: int) -> list[GaussianMechanism]:
    """Noise multipliers whose costs, summed plainly in this order, fall below their
    exact sum (found by search; the test checks that they still do)."""
    for seed in range(1000):
        rng = random.Random(seed)
        mechanisms = [GaussianMechanism(rng.uniform(50.0, 400.0)) for _ in range(count)]
        plain, exact = 0.0, Fraction(0)
        for mechanism in mechanisms:
            plain += mechanism.zcdp_rho
            exact += Fraction(mechanism.zcdp_rho)
        if Fraction(plain) < exact:
            return mechanisms
    raise AssertionError("no sequence whose plain float sum is below its exact sum")


def test_a_stored_account_is_never_below_the_exact_sum_of_its_charges(ledger_url):
    """Through the real SQL updates (commit charges the account set-based) on SQLite and
    PostgreSQL: the stored rho, and the eps it gives, are at least the exact ones."""
    releases = _adversarial_releases(200)
    ledger = PrivacyBudgetLedger(BudgetCap(1e6, 1e-5), url=ledger_url)
    key = key_for("alice", "heatmap", "2026-w45")
    try:
        for number, mechanism in enumerate(releases):
            ledger.commit(ledger.reserve(key, mechanism, attempt=f"sum/{number}"))
        with ledger.reading() as connection:
            stored, costs = (
                connection.execute(
                    sa.text("SELECT rho FROM dp_accounts"),
                ).scalar_one(),
                [
                    row[0]
                    for row in connection.execute(sa.text("SELECT cost_rho FROM dp_reservations"))
                ],
            )
        exact = sum(map(Fraction, costs), Fraction(0))
        assert len(costs) == len(releases)
        assert Fraction(stored) >= exact
        assert Fraction(stored) - exact <= exact * Fraction(6 * len(costs), 2**53)
        assert ledger.verify().ok
    finally:
        ledger.close()


@pytest.mark.parametrize("value", [0.0, 1e-300, 1.0, 1e300])
def test_rounding_up_never_overflows_a_finite_sum(value):
    assert np.isfinite(sum_up(value, 0.0))
