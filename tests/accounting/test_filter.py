"""The cap as a privacy filter: one Rényi order per cap, and what is compared there."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    GaussianMechanism,
    LaplaceMechanism,
    PureDPMechanism,
    RDPAccountant,
    rdp_to_epsilon,
)
from dp_budget_provider.accounting.conversion import conversion_terms
from dp_budget_provider.accounting.filter import filter_epsilon, filter_order

DELTA = 1e-5
ORDERS = np.asarray(DEFAULT_ORDERS, dtype=np.float64)


def largest_fitting_rho(cap: float) -> float:
    """The largest zCDP rho whose curve converts (least over the grid) to at most ``cap``."""
    low, high = 0.0, 100.0
    for _ in range(200):
        middle = (low + high) / 2
        if rdp_to_epsilon(ORDERS, middle * ORDERS, DELTA)[0] <= cap:
            low = middle
        else:
            high = middle
    return low


@pytest.mark.parametrize(("cap", "order"), [(0.5, 32.0), (1.0, 18.0), (3.0, 7.5), (8.0, 3.9)])
def test_the_order_is_where_a_zcdp_curve_reaching_the_cap_does_so(cap, order):
    assert filter_order(ORDERS, cap, DELTA, "improved") == order
    # The same order the least-over-the-grid conversion picks for that curve.
    rho = largest_fitting_rho(cap)
    assert rdp_to_epsilon(ORDERS, rho * ORDERS, DELTA)[1] == order


@given(cap=st.floats(0.05, 20.0), rho=st.floats(1e-6, 5.0))
def test_on_zcdp_curves_the_filter_grants_what_the_least_over_the_grid_grants(cap, rho):
    order = filter_order(ORDERS, cap, DELTA, "improved")
    checked = filter_epsilon(ORDERS, rho * ORDERS, order, DELTA, "improved")
    least = rdp_to_epsilon(ORDERS, rho * ORDERS, DELTA)[0]
    assert checked >= least
    # Both decide alike, but within rounding of the boundary.
    if abs(least - cap) > 1e-9 * cap:
        assert (checked <= cap) == (least <= cap), (cap, rho, checked, least)


@pytest.mark.parametrize("conversion", ["improved", "classic"])
def test_on_other_curves_the_filter_is_never_looser(conversion):
    accountant = RDPAccountant(ORDERS)
    accountant.compose(GaussianMechanism(3.0))
    accountant.compose(LaplaceMechanism(0.4), 3)
    accountant.compose(PureDPMechanism(0.3))
    curve = accountant.rdp
    least = rdp_to_epsilon(ORDERS, curve, DELTA, conversion)[0]
    for cap in (0.5, 1.0, 3.0, 8.0):
        order = filter_order(ORDERS, cap, DELTA, conversion)
        checked = filter_epsilon(ORDERS, curve, order, DELTA, conversion)
        assert checked >= least
        index = int(np.flatnonzero(order == ORDERS)[0])
        assert checked == pytest.approx(
            curve[index] + conversion_terms(ORDERS, DELTA, conversion)[index], rel=1e-12
        )


def test_the_classic_conversion_has_its_own_order():
    order = filter_order(ORDERS, 1.0, DELTA, "classic")
    budgets = (1.0 - np.log(1 / DELTA) / (ORDERS - 1)) / ORDERS
    assert order == ORDERS[int(np.argmax(budgets))]


def test_an_order_off_the_grid_is_refused():
    with pytest.raises(ValueError, match="not an order of the grid"):
        filter_epsilon(ORDERS, 0.1 * ORDERS, 17.25, DELTA, "improved")
