"""Soundness: never report less than the true loss, never looser than basic composition."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize, stats

from dp_budget_provider.accounting import (
    GaussianMechanism,
    LaplaceMechanism,
    RDPAccountant,
    basic_composition,
    continuous_optimal_epsilon,
    zcdp_to_dp,
)
from dp_budget_provider.accounting.conversion import rdp_to_epsilon


def scipy_exact_gaussian_epsilon(mu, delta):
    """Independent (scipy) solution of the Balle-Wang curve, the ground truth."""

    def excess(eps):
        first = math.exp(stats.norm.logcdf(-eps / mu + mu / 2))
        second = math.exp(eps + stats.norm.logcdf(-eps / mu - mu / 2))
        return first - second - delta

    if excess(0.0) <= 0:
        return 0.0
    upper = 1.0
    while excess(upper) > 0:
        upper *= 2
    return optimize.brentq(excess, 0.0, upper, xtol=1e-14, rtol=1e-15)


gaussian_sequences = st.lists(
    st.tuples(st.floats(0.5, 40.0), st.integers(1, 200)), min_size=1, max_size=10
)


@settings(max_examples=300, deadline=None)
@given(gaussian_sequences, st.sampled_from([1e-4, 1e-5, 1e-6, 1e-8]))
def test_reported_epsilon_never_below_exact_gaussian(sequence, delta):
    accountant = RDPAccountant()
    for z, count in sequence:
        accountant.compose(GaussianMechanism(z), count)
    mu = math.sqrt(sum(count / z**2 for z, count in sequence))
    truth = scipy_exact_gaussian_epsilon(mu, delta)
    for conversion in ("improved", "classic"):
        reported = accountant.get_epsilon(delta, conversion)[0]
        assert reported >= truth - 1e-9 * max(1.0, truth)
    # ...and the default report is the exact value itself.
    assert accountant.get_epsilon(delta)[0] == pytest.approx(truth, rel=1e-8, abs=1e-10)


@settings(max_examples=60, deadline=None)  # each example optimises over continuous orders
@given(
    st.floats(0.5, 40.0),
    st.integers(1, 500),
    st.sampled_from([1e-5, 1e-6]),
    st.sampled_from(["improved", "classic"]),
)
def test_grid_never_beats_continuous_optimum_and_stays_within_ten_percent(z, k, delta, conv):
    rho = k / (2 * z**2)
    accountant = RDPAccountant()
    accountant.compose(GaussianMechanism(z), k)
    grid, _ = rdp_to_epsilon(accountant.orders, accountant.rdp, delta, conv)
    continuous, _ = continuous_optimal_epsilon(lambda a: rho * a, delta, conv)
    assert grid >= continuous - 1e-9 * continuous
    assert grid - continuous <= 0.10 * continuous


def test_improved_conversion_is_below_classic_closed_form():
    # DESIGN.md: with the improved formula the grid is below the classic closed form.
    accountant = RDPAccountant()
    accountant.compose(GaussianMechanism(4.0), 20)
    improved, _ = rdp_to_epsilon(accountant.orders, accountant.rdp, 1e-5, "improved")
    assert improved < zcdp_to_dp(20 / 32, 1e-5)


@settings(max_examples=200, deadline=None)
@given(st.floats(1.0, 40.0), st.integers(2, 1000), st.sampled_from([1e-5, 1e-6]))
def test_rdp_never_looser_than_basic_composition(z, k, delta):
    rho = 1 / (2 * z**2)
    single = zcdp_to_dp(rho, delta)
    accountant = RDPAccountant()
    accountant.compose(GaussianMechanism(z), k)
    for conversion in ("improved", "classic"):
        assert accountant.get_epsilon(delta, conversion)[0] <= basic_composition(single, k) + 1e-9


@settings(max_examples=100, deadline=None)
@given(st.floats(0.01, 2.0), st.integers(1, 1000))
def test_laplace_rdp_never_looser_than_basic_pure_composition(eps0, k):
    accountant = RDPAccountant()
    accountant.compose(LaplaceMechanism(eps0), k)
    # k eps0-DP releases are (k eps0, 0)-DP; an RDP conversion at delta > 0 may not exceed it
    # by more than the grid's residual at the largest order.
    residual = math.log(1e5) / (accountant.orders[-1] - 1)
    assert accountant.get_epsilon(1e-5, "classic")[0] <= k * eps0 + residual + 1e-12


def test_all_zero_curve_is_zero_epsilon():
    accountant = RDPAccountant()
    assert accountant.get_epsilon(1e-5) == (0.0, None)
    assert accountant.get_epsilon(1e-5, "classic") == (0.0, None)
    assert np.all(accountant.rdp == 0)
