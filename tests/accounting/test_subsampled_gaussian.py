"""Tests for the Poisson-subsampled Gaussian RDP curve; dp_accounting is the oracle.

About the monotonicity properties: at *fractional* orders the curve is the smaller of
dp_accounting's series with |binomial coefficients| (summed completely: tail and
rounding bounded) and the chord between the integer orders around it. The series is a
valid but sometimes loose upper bound. For large noise and q near 1/2 it rises above the
value at the next integer order, and even above the unsampled Gaussian curve
(dp_accounting itself gives RDP(1.1) = 0.19 > RDP(2) = 0.0025 at z = 10, q = 0.5).
So "non-decreasing in alpha / q" and "below the unsampled Gaussian" are checked
over the whole curve only where the reference satisfies them. Everywhere else
they are checked at the exact integer orders. Fractional orders are checked
against the lower bound RDP(alpha) >= RDP(floor(alpha)).
"""

from __future__ import annotations

import functools
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    PoissonSubsampledGaussianMechanism,
    RDPAccountant,
)
from dp_budget_provider.accounting import subsampled_gaussian as sg
from dp_budget_provider.accounting.special import log_erfc
from dp_budget_provider.accounting.subsampled_gaussian import poisson_subsampled_gaussian_rdp
from tests.accounting import mp_oracles

ORDERS = np.array(rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=np.float64)
IS_INT = ORDERS % 1 == 0
Z_GRID = (0.5, 0.8, 1.0, 1.1, 2.0, 4.0, 10.0)
Q_GRID = (1e-4, 1e-3, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 0.99, 1.0)
# Noise levels where dp_accounting's fractional-order bound is monotone and below the
# unsampled Gaussian curve at every q in Q_GRID.
Z_TIGHT = tuple(z for z in Z_GRID if z <= 1.1)
RTOL, ATOL = 1e-6, 1e-12
# dp_accounting truncates its fractional series after a term below e^-30; the tail it drops
# (which we bound and add), and the bound on our rounding, are up to about 1e-10 in log A
# (at z = 0.5, q = 2^-7, alpha = 1.1: 2.3e-10). RDP is log A / (alpha - 1), so the allowance
# grows as alpha nears 1.
FRACTIONAL_LOG_A_ATOL = 1e-9


@functools.cache
def reference_rdp(z: float, q: float, orders: tuple[float, ...] = tuple(ORDERS)) -> np.ndarray:
    accountant = rdp_privacy_accountant.RdpAccountant(orders=list(orders))
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
    return np.array(accountant._rdp, dtype=np.float64)  # no public getter for the raw curve


def rdp(z: float, q: float, orders: np.ndarray = ORDERS) -> np.ndarray:
    return poisson_subsampled_gaussian_rdp(z, q, orders)


def gaussian(z: float, orders: np.ndarray = ORDERS) -> np.ndarray:
    return orders / (2 * z**2)


@pytest.fixture
def fresh_cache():
    sg._rdp_curve.cache_clear()
    yield
    sg._rdp_curve.cache_clear()


# ------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("q", Q_GRID)
@pytest.mark.parametrize("z", Z_GRID)
def test_matches_dp_accounting_on_grid(z, q):
    ours = rdp(z, q)
    assert ours.dtype == np.float64 and ours.shape == ORDERS.shape
    assert np.all(np.isfinite(ours))
    assert_matches_reference(ours, reference_rdp(z, q), ORDERS)


def assert_matches_reference(ours, reference, orders):
    """Equal at integer orders; at fractional ones never looser than dp_accounting's
    truncated series beyond its tail and rounding (we may be tighter: the chord)."""
    whole = orders % 1 == 0
    np.testing.assert_allclose(ours[whole], reference[whole], rtol=RTOL, atol=ATOL)
    allowance = FRACTIONAL_LOG_A_ATOL / (orders[~whole] - 1.0)
    assert np.all(ours[~whole] <= reference[~whole] * (1 + RTOL) + allowance)


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(
    z=st.floats(min_value=0.5, max_value=20.0),
    q=st.one_of(
        st.floats(min_value=1e-5, max_value=1.0),
        st.floats(min_value=-5.0, max_value=0.0).map(lambda e: 10.0**e),  # log-uniform
    ),
    orders=st.lists(st.sampled_from(ORDERS.tolist()), min_size=1, max_size=8, unique=True),
)
def test_matches_dp_accounting_random(z, q, orders):
    orders = tuple(orders)
    ours = rdp(z, q, np.array(orders))
    assert_matches_reference(ours, reference_rdp(z, q, orders), np.array(orders))


@pytest.mark.parametrize("z", (0.3, 0.5, 1.0, 1.1, 3.7, 100.0))
def test_full_sampling_is_unsampled_gaussian_exactly(z):
    ours = rdp(z, 1.0)
    assert ours.tolist() == [a / (2 * z**2) for a in ORDERS.tolist()]
    assert np.array_equal(ours, reference_rdp(z, 1.0))
    assert rdp(z, 1).tolist() == ours.tolist()  # int sampling rate 1


# --------------------------------------------------------------------- properties


@pytest.mark.parametrize("z", Z_GRID)
def test_integer_orders_non_decreasing_in_alpha(z):
    for q in Q_GRID:
        curve = rdp(z, q)[IS_INT]
        assert np.all(np.diff(curve) >= 0), (z, q)


@pytest.mark.parametrize("z", Z_TIGHT)
def test_full_curve_non_decreasing_in_alpha_where_reference_is(z):
    for q in Q_GRID:
        assert np.all(np.diff(rdp(z, q)) >= 0), (z, q)


@pytest.mark.parametrize("z", Z_GRID)
def test_non_decreasing_in_sampling_rate(z):
    table = np.array([rdp(z, q) for q in sorted(Q_GRID)])
    steps = np.diff(table, axis=0)
    assert np.all(steps[:, IS_INT] >= 0)
    if z in Z_TIGHT:
        assert np.all(steps >= 0)


@pytest.mark.parametrize("z", Z_GRID)
def test_subsampling_never_exceeds_unsampled_gaussian(z):
    bound = gaussian(z)
    for q in Q_GRID:
        curve = rdp(z, q)
        assert np.all(curve[IS_INT] <= bound[IS_INT]), (z, q)
        if z in Z_TIGHT:
            assert np.all(curve <= bound), (z, q)


@pytest.mark.parametrize("z", Z_GRID)
def test_fractional_orders_are_upper_bounds(z):
    # True RDP is non-decreasing in alpha, and integer orders are exact. So a valid
    # bound at fractional alpha can never be below the value at floor(alpha).
    frac = ~IS_INT & (ORDERS > 2)
    floors = np.floor(ORDERS[frac])
    for q in Q_GRID:
        ours = rdp(z, q)
        at_floor = rdp(z, q, floors)
        assert np.all(ours[frac] >= at_floor * (1 - 1e-12)), (z, q)


@pytest.mark.parametrize("z", (0.3, 0.5, 1.0, 3.0, 10.0, 30.0, 100.0))
def test_finite_and_positive_over_supported_range(z):
    for q in (1e-6, 1e-5, 1e-3, 0.1, 0.5, 0.7, 0.999999, 1.0):
        curve = rdp(z, q)
        assert np.all(np.isfinite(curve)), (z, q)
        assert np.all(curve > 0), (z, q)


def test_tiny_values_keep_relative_accuracy():
    # Exact at integer order 2: A_2 = 1 + q^2 (exp(1/z^2) - 1), so RDP(2) = log1p(...).
    # dp_accounting has about 1e-5 relative error here; we must be exact.
    for z, q in ((100.0, 1e-6), (20.0, 1e-5), (4.0, 1e-4)):
        exact = math.log1p(q * q * math.expm1(1 / z**2))
        assert rdp(z, q, np.array([2.0]))[0] == pytest.approx(exact, rel=1e-13)


# ----------------------------------------------------------------- extreme inputs


@pytest.mark.parametrize("q", (1e-6, 0.3, 0.5, 0.999999))
def test_tiny_noise_gives_huge_or_infinite_values_never_nan(q):
    huge = rdp(1e-3, q)
    assert np.all(np.isfinite(huge)) and np.all(huge > 1e5)
    assert np.all(rdp(1e-200, q) == np.inf)


@pytest.mark.parametrize("z", (1e4, 1e200))
@pytest.mark.parametrize("q", (1e-300, 0.3, 0.5))
def test_huge_noise_or_tiny_rate_never_nan_or_negative(z, q):
    curve = rdp(z, q)
    assert not np.any(np.isnan(curve))
    assert np.all(curve >= 0)


def test_extreme_orders():
    orders = np.array([1 + 1e-9, 1e6 + 0.5, 2.0**22, 1e300])
    curve = rdp(1.0, 0.01, orders)
    assert np.all(np.isfinite(curve)) and np.all(curve > 0)
    assert np.all(curve <= gaussian(1.0, orders))
    # Integer orders beyond the series limit fall back to the unsampled Gaussian bound.
    assert curve[2:].tolist() == gaussian(1.0, orders[2:]).tolist()


def test_unconverged_fractional_series_falls_back_to_the_chord(monkeypatch, fresh_cache):
    monkeypatch.setattr(sg, "_MAX_SERIES_TERMS", 40)  # z = 1, q = 0.5 needs > 40 at alpha < 3
    orders = np.array([1.1, 1.5, 2.5])
    ours = rdp(1.0, 0.5, orders)
    log_a = {1: 0.0, 2: rdp(1.0, 0.5, np.array([2.0]))[0], 3: 2 * rdp(1.0, 0.5, np.array([3.0]))[0]}
    chord = [
        ((n + 1 - a) * log_a[n] + (a - n) * log_a[n + 1]) / (a - 1)
        for a in orders
        for n in [int(a)]
    ]
    np.testing.assert_allclose(ours, chord, rtol=1e-14)


# ------------------------------------------------------------------ log erfc helper


def test_log_erfc_matches_scipy_including_far_tails():
    x = np.concatenate(
        [np.linspace(-40, 40, 8001), np.geomspace(8, 1e6, 2000), [7.999999, 8.0, 12.0, 24.0]]
    )
    ours = log_erfc(x)
    expected = math.log(2) + special.log_ndtr(-x * math.sqrt(2))
    np.testing.assert_allclose(ours, expected, rtol=1e-13, atol=1e-15)


def test_log_erfc_special_values():
    with np.errstate(over="ignore"):
        out = log_erfc(np.array([np.inf, -np.inf, np.nan, 1e200, -1e200]))
    assert out[0] == -np.inf and out[1] == math.log(2) and np.isnan(out[2])
    assert out[3] == -np.inf and out[4] == math.log(2)


# ------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "value", [0, 0.0, -1.0, math.nan, math.inf, -math.inf, True, False, "1.0", None, [1.0], 1j]
)
def test_rejects_bad_noise_multiplier(value):
    with pytest.raises(ValueError, match="noise_multiplier"):
        poisson_subsampled_gaussian_rdp(value, 0.1, ORDERS)


@pytest.mark.parametrize(
    "value", [0, 0.0, -0.1, 1.0000001, 2, math.nan, math.inf, True, "0.5", None, [0.5]]
)
def test_rejects_bad_sampling_rate(value):
    with pytest.raises(ValueError, match="sampling_rate"):
        poisson_subsampled_gaussian_rdp(1.0, value, ORDERS)


@pytest.mark.parametrize(
    "orders",
    [[1.0], [0.5], [2.0, 1.0], [-3], [math.nan], [math.inf], ["2"], ["a"], None, [[2.0], [3, 4]]],
)
def test_rejects_bad_orders(orders):
    with pytest.raises(ValueError, match="orders"):
        poisson_subsampled_gaussian_rdp(1.0, 0.1, orders)


def test_accepts_numpy_scalars_and_sequences():
    expected = rdp(1.1, 0.01, np.array([2.0, 3.5]))
    got = poisson_subsampled_gaussian_rdp(np.float32(1.1), np.float64(0.01), [2, 3.5])
    np.testing.assert_allclose(got, expected, rtol=1e-7)  # float32 1.1 != 1.1
    assert poisson_subsampled_gaussian_rdp(np.int64(2), 1, (3,)).tolist() == [3 / 8]


# ---------------------------------------------------------------- output contract


def test_output_shape_dtype_and_no_aliasing_of_cache():
    orders = np.array([[1.5, 2.0], [8.0, 1.5]])
    first = poisson_subsampled_gaussian_rdp(1.1, 0.01, orders)
    assert first.shape == (2, 2) and first.dtype == np.float64
    assert first[0, 0] == first[1, 1]
    assert orders.tolist() == [[1.5, 2.0], [8.0, 1.5]]  # input untouched
    keep = first.copy()
    first[...] = -1.0  # callers may mutate results; the cache must not see it
    np.testing.assert_array_equal(poisson_subsampled_gaussian_rdp(1.1, 0.01, orders), keep)
    assert poisson_subsampled_gaussian_rdp(1.1, 0.01, np.array([], dtype=float)).shape == (0,)


# ------------------------------------------------------- exact values (mpmath, 60 digits)


@pytest.mark.parametrize(
    ("z", "q", "order"),
    [
        (1.0, 0.01, 5.5),
        (4.0, 0.5, 1.5),  # the loose regime: the chord bounds it
        (0.8, 0.05, 10.9),
        (10.0, 0.3, 63.5),
        (10.0, 0.3, 90.5),  # was 0.0: dp_accounting's series stopped at index 0
        (10.0, 0.3, 1024.5),
        (2.0, 0.05, 3000.5),
    ],
)
def test_fractional_orders_are_upper_bounds_of_the_exact_curve(z, q, order):
    exact = mp_oracles.subsampled_gaussian_rdp(z, q, order)
    assert rdp(z, q, np.array([order]))[0] >= exact


@pytest.mark.parametrize(("z", "q", "order"), [(1.0, 0.01, 2.0), (10.0, 0.3, 1024.0)])
def test_integer_orders_match_the_exact_curve(z, q, order):
    # Also checks the oracle's quadrature against the finite binomial sum.
    exact = mp_oracles.subsampled_gaussian_rdp(z, q, order)
    binomial = mp_oracles.subsampled_gaussian_rdp_binomial(z, q, int(order))
    assert abs(exact - binomial) / binomial < 1e-40
    ours = rdp(z, q, np.array([order]))[0]
    assert 0 <= float((ours - exact) / exact) < 1e-13


@pytest.mark.parametrize(
    ("z", "q", "order"),
    [
        (222.77831096910003, 0.010696740049061158, 512),  # was 2.9e-13 below exact
        (81.17766357143489, 0.004882996010938129, 512),  # was 2.1e-13 below
        (50.0, 0.01, 4096),  # was 1.3e-12 below
        (200.0, 0.01, 4096),  # was 1.5e-12 below
        (3.0, 0.01, 63),
        (100.0, 1e-6, 2),
    ],
)
def test_integer_orders_bound_the_exact_curve_where_log_factorials_cancel(z, q, order):
    # log C(a, i) = log a! - log i! - log (a-i)! loses ulps of log a!: the sum is raised by
    # that, so it is at or above exact, and by at most ~1e-10 relative at order 4096.
    exact = mp_oracles.subsampled_gaussian_rdp_binomial(z, q, order)
    ours = rdp(z, q, np.array([float(order)]))[0]
    assert 0 <= float((ours - exact) / exact) < 2e-10


def test_a_grid_with_a_large_fractional_order_never_reports_zero():
    mechanism = PoissonSubsampledGaussianMechanism(10.0, 0.3)
    extended = RDPAccountant([*DEFAULT_ORDERS.tolist(), 90.5])
    extended.compose(mechanism, 1000)
    default = RDPAccountant()
    default.compose(mechanism, 1000)
    # Adding an order may only lower the minimum where the curve there is a valid bound;
    # the order 90.5 is not a better one for this mechanism (its exact RDP is above).
    exact_at_90_5 = 1000 * mp_oracles.subsampled_gaussian_rdp(10.0, 0.3, 90.5)
    assert extended.rdp[-1] >= exact_at_90_5
    assert extended.get_epsilon(1e-5)[0] == default.get_epsilon(1e-5)[0] > 4.0
