"""``rdp_to_epsilon`` keeps its grid's curve-independent terms: the results must not move.

The conversion computes the per-order terms of a grid once and reuses them for every
curve (the ledger converts twice per release). These tests compare it, bit for bit,
with the formulas evaluated in one expression per curve, as dp_accounting writes them,
on random curves and grids, orders at and below the 1.01 floor, infinite curve values
and curves small enough for the Bretagnolle-Huber shortcut.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_budget_provider.accounting import DEFAULT_ORDERS
from dp_budget_provider.accounting.conversion import CURVE_ROUNDING, rdp_to_epsilon


def plain(orders: np.ndarray, rdp: np.ndarray, delta: float, conversion: str) -> tuple:
    """The conversion written out per curve (the form before the terms were kept), with
    its outward rounding: the curve raised by CURVE_ROUNDING, the result by 8 ulps of
    the magnitude of its terms."""
    if not np.any(rdp):
        return 0.0, None
    rdp = rdp * (1.0 + CURVE_ROUNDING)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if conversion == "classic":
            first, second = math.log(1.0 / delta) / (orders - 1.0), np.zeros(orders.size)
        else:
            first = np.where(orders > 1.01, np.log1p(-1.0 / orders), 0.0)
            second = np.where(orders > 1.01, np.log(delta * orders) / (orders - 1.0), 0.0)
        if conversion == "classic":
            per_order = rdp + math.log(1.0 / delta) / (orders - 1.0)
        else:
            improved = rdp + np.log1p(-1.0 / orders) - np.log(delta * orders) / (orders - 1.0)
            improved = np.where(orders > 1.01, improved, np.inf)
            per_order = np.where(delta**2 + np.expm1(-rdp) > 0.0, 0.0, improved)
    best = int(np.argmin(per_order))
    epsilon = float(per_order[best])
    if epsilon > 0.0:
        epsilon += 8 * 2.0**-53 * float(rdp[best] + abs(first[best]) + abs(second[best]))
    return max(0.0, epsilon), float(orders[best])


GRIDS = [
    np.asarray(DEFAULT_ORDERS, dtype=np.float64),
    np.array([1.001, 1.01, 1.02, 1.5, 2.0, 3.0, 8.0, 64.0, 1e4]),
    np.linspace(1.0, 100.0, 57)[1:],
]


@settings(max_examples=300, deadline=None)
@given(
    grid=st.sampled_from(range(len(GRIDS))),
    delta=st.sampled_from([1e-12, 1e-9, 1e-5, 0.3]),
    conversion=st.sampled_from(["improved", "classic"]),
    scale=st.floats(min_value=1e-16, max_value=1e8),
    shape=st.sampled_from(["linear", "noisy", "infinite tail", "zero"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_same_bits_as_the_formula_per_curve(grid, delta, conversion, scale, shape, seed) -> None:
    orders = GRIDS[grid]
    rng = np.random.default_rng(seed)
    rdp = scale * orders
    if shape == "noisy":
        rdp = rdp + scale * rng.uniform(0.0, 1.0, orders.size)
    elif shape == "infinite tail":
        rdp = rdp.copy()
        rdp[-3:] = np.inf
    elif shape == "zero":
        rdp = np.zeros(orders.size)
    assert rdp_to_epsilon(orders, rdp, delta, conversion) == plain(orders, rdp, delta, conversion)


def test_terms_of_one_grid_do_not_leak_into_another() -> None:
    """The same curve values on two grids and two deltas: each call uses its own terms."""
    for orders in GRIDS:
        for delta in (1e-5, 1e-9):
            rdp = 0.01 * orders
            assert rdp_to_epsilon(orders, rdp, delta) == plain(orders, rdp, delta, "improved")


@pytest.mark.parametrize("order", [0.5, 1.0, np.nan, np.inf])
def test_orders_that_would_give_a_wrong_number_are_refused(order: float) -> None:
    orders = np.array([order, 2.0, 3.0])
    with pytest.raises(ValueError, match="orders"):
        rdp_to_epsilon(orders, np.array([1.0, 1.0, 1.5]), 1e-5)


def test_a_curve_of_another_length_is_refused() -> None:
    with pytest.raises(ValueError, match="one value per order"):
        rdp_to_epsilon(np.array([2.0, 3.0]), np.array([1.0, 1.0, 1.5]), 1e-5)


@pytest.mark.parametrize("bad", [np.nan, -1e-12])
def test_nan_or_negative_curves_are_still_refused(bad: float) -> None:
    orders = GRIDS[0]
    rdp = 0.1 * orders
    rdp[7] = bad
    with pytest.raises(ValueError, match="NaN or negative"):
        rdp_to_epsilon(orders, rdp, 1e-5)


def test_advanced_composition_of_a_huge_epsilon_is_infinite_not_an_overflow() -> None:
    from dp_budget_provider.accounting.conversion import advanced_composition

    assert advanced_composition(1e9, 1e-5, 10) == math.inf
