"""Mechanisms: validated parameters, correct curves, JSON spec round trips."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    GaussianMechanism,
    LaplaceMechanism,
    Mechanism,
    PoissonSubsampledGaussianMechanism,
    PureDPMechanism,
    RDPAccountant,
    ZCDPMechanism,
)
from dp_budget_provider.accounting.conversion import CURVE_ROUNDING
from tests.accounting import mp_oracles

ALL = [
    GaussianMechanism(2.5),
    LaplaceMechanism(0.7),
    PureDPMechanism(1.2),
    ZCDPMechanism(0.05),
    PoissonSubsampledGaussianMechanism(1.1, 0.01),
]


@pytest.mark.parametrize("mechanism", ALL, ids=lambda m: m.kind)
def test_spec_round_trip_through_json(mechanism):
    spec = json.loads(json.dumps(mechanism.to_spec()))
    assert spec["kind"] == mechanism.kind
    rebuilt = Mechanism.from_spec(spec)
    assert rebuilt == mechanism
    assert type(mechanism).from_spec(spec) == mechanism
    np.testing.assert_array_equal(rebuilt.rdp(DEFAULT_ORDERS), mechanism.rdp(DEFAULT_ORDERS))


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "gaussian"},
        {"kind": "gaussian", "noise_multiplier": 1.0, "extra": 2},
        {"kind": "banana", "noise_multiplier": 1.0},
        {"noise_multiplier": 1.0},
        {"kind": "gaussian", "noise_multiplier": "1.0"},
        {"kind": "gaussian", "noise_multiplier": float("nan")},
        {"kind": "laplace", "epsilon0": -1},
        ["gaussian", 1.0],
        None,
    ],
)
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError):
        Mechanism.from_spec(spec)


def test_spec_of_wrong_kind_for_subclass_is_refused():
    with pytest.raises(ValueError, match="expected 'laplace'"):
        LaplaceMechanism.from_spec(GaussianMechanism(1.0).to_spec())


BAD_VALUES = [0, 0.0, -1.0, float("nan"), float("inf"), -float("inf"), True, "1", None, [1.0]]


@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (GaussianMechanism, "noise_multiplier"),
        (LaplaceMechanism, "epsilon0"),
        (PureDPMechanism, "epsilon0"),
        (ZCDPMechanism, "rho"),
        (lambda v: PoissonSubsampledGaussianMechanism(v, 0.5), "noise_multiplier"),
        (lambda v: PoissonSubsampledGaussianMechanism(1.0, v), "sampling_rate"),
    ],
)
def test_bad_parameters_raise_naming_parameter_and_value(factory, name, value):
    with pytest.raises(ValueError, match=name) as excinfo:
        factory(value)
    assert repr(value) in str(excinfo.value)


@pytest.mark.parametrize("rate", [1.0000001, 2.0, -0.1, 0.0])
def test_sampling_rate_outside_unit_interval_is_refused(rate):
    with pytest.raises(ValueError, match="sampling_rate"):
        PoissonSubsampledGaussianMechanism(1.0, rate)


def test_gaussian_from_sigma_and_curve():
    mechanism = GaussianMechanism.from_sigma(sigma=8.0, l2_sensitivity=2.0)
    assert mechanism.noise_multiplier == 4.0
    np.testing.assert_array_equal(mechanism.rdp(DEFAULT_ORDERS), DEFAULT_ORDERS / 32.0)
    with pytest.raises(ValueError, match="l2_sensitivity"):
        GaussianMechanism.from_sigma(1.0, 0.0)


def mironov_laplace(a, e):
    """Mironov's textbook formula, in exact arithmetic via mpmath."""
    import mpmath

    mpmath.mp.dps = 50
    a, e = mpmath.mpf(a), mpmath.mpf(e)
    term = a / (2 * a - 1) * mpmath.exp((a - 1) * e) + (a - 1) / (2 * a - 1) * mpmath.exp(-a * e)
    return float(mpmath.log(term) / (a - 1))


@given(st.floats(1e-3, 60.0), st.sampled_from(list(DEFAULT_ORDERS)))
def test_laplace_rdp_equals_mironov_formula_to_1e12(eps0, order):
    ours = LaplaceMechanism(eps0).rdp(np.array([order]))[0]
    assert ours == pytest.approx(mironov_laplace(order, eps0), rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("eps0", [1e-4, 0.5, 5.0, 50.0, 500.0])
def test_laplace_rdp_is_finite_positive_and_at_most_eps0(eps0):
    curve = LaplaceMechanism(eps0).rdp(DEFAULT_ORDERS)
    assert np.all(np.isfinite(curve)) and np.all(curve > 0)
    assert np.all(curve <= eps0 * (1 + 1e-15))
    assert np.all(np.diff(curve) >= 0)  # Rényi divergence grows with the order


def test_naive_laplace_formula_overflows_where_ours_does_not():
    a, e = 256.0, 5.0
    with np.errstate(over="ignore"):
        naive = np.log(a / (2 * a - 1) * np.exp((a - 1) * e)) / (a - 1)
    assert not np.isfinite(naive)
    assert math.isfinite(LaplaceMechanism(e).rdp(np.array([a]))[0])


def randomised_response_rdp(a, e):
    """D_a between Bernoulli(p) and Bernoulli(1-p), p = e^eps/(1+e^eps), in 50-digit arithmetic."""
    import mpmath

    mpmath.mp.dps = 50
    a, e = mpmath.mpf(a), mpmath.mpf(e)
    p = mpmath.exp(e) / (1 + mpmath.exp(e))
    total = p**a * (1 - p) ** (1 - a) + (1 - p) ** a * p ** (1 - a)
    return float(mpmath.log(total) / (a - 1))


@given(st.floats(1e-3, 30.0), st.sampled_from(list(DEFAULT_ORDERS)))
def test_pure_dp_curve_is_randomised_response_and_below_both_classic_bounds(eps0, order):
    ours = PureDPMechanism(eps0).rdp(np.array([order]))[0]
    assert ours == pytest.approx(randomised_response_rdp(order, eps0), rel=1e-9, abs=1e-15)
    assert ours <= order * eps0**2 / 2 and ours <= eps0


def test_pure_dp_bounds_the_geometric_mechanism_and_is_tighter_than_zcdp():
    # Discrete Laplace with eps0 = 1/scale at sensitivity 1: exact Rényi divergence by summation.
    eps0, a = 0.7, 3.0
    ys = np.arange(-400, 401)
    p = np.exp(-eps0 * np.abs(ys))
    p /= p.sum()
    q = np.exp(-eps0 * np.abs(ys - 1))
    q /= q.sum()
    geometric = np.log(np.sum(p**a * q ** (1 - a))) / (a - 1)
    assert geometric <= PureDPMechanism(eps0).rdp(np.array([a]))[0] + 1e-12
    assert (
        geometric > LaplaceMechanism(eps0).rdp(np.array([a]))[0]
    )  # continuous curve would under-count
    assert np.all(PureDPMechanism(0.5).rdp(DEFAULT_ORDERS) < DEFAULT_ORDERS * 0.125)


def test_zcdp_curve():
    np.testing.assert_array_equal(ZCDPMechanism(0.3).rdp(DEFAULT_ORDERS), DEFAULT_ORDERS * 0.3)
    assert ZCDPMechanism(0.3).zcdp_rho == 0.3 and PureDPMechanism(0.3).zcdp_rho is None


def test_mechanisms_are_frozen_and_hashable():
    mechanism = GaussianMechanism(1.0)
    with pytest.raises(AttributeError):
        mechanism.noise_multiplier = 2.0
    assert len({GaussianMechanism(1.0), GaussianMechanism(1)}) == 1


# ------------------------------------------- exact curves at tiny and huge eps0 (mpmath)

EXTREME_EPSILONS = (3e-9, 1e-8, 1e-7, 1e-4, 0.3, 5.0, 80.0, 1e3)
ORDERS_UP_TO_HUGE = np.array([1.01, 1.1, 1.5, 2.0, 3.5, 10.0, 63.0, 256.0, 1024.0, 1e5])


def assert_bounds_exact(ours, exact_at):
    """Each value at or above the exact one up to the conversion's CURVE_ROUNDING allowance
    (it covers a curve's last ulps), and within 1e-12 of it."""
    for order, value in zip(ORDERS_UP_TO_HUGE, ours, strict=True):
        exact = exact_at(float(order))
        assert value >= exact * (1 - CURVE_ROUNDING / 4), (order, value, exact)
        assert value <= exact * (1 + 1e-12), (order, value, exact)


@pytest.mark.parametrize("eps0", EXTREME_EPSILONS)
def test_pure_dp_curve_bounds_exact_randomised_response(eps0):
    ours = PureDPMechanism(eps0).rdp(ORDERS_UP_TO_HUGE)
    assert_bounds_exact(ours, lambda a: mp_oracles.randomised_response_rdp(a, eps0))


@pytest.mark.parametrize("eps0", EXTREME_EPSILONS)
def test_laplace_curve_bounds_exact_curve(eps0):
    ours = LaplaceMechanism(eps0).rdp(ORDERS_UP_TO_HUGE)
    assert_bounds_exact(ours, lambda a: mp_oracles.laplace_rdp(a, eps0))


LAPLACE_BOUND = 2.0**-46  # what accounting/laplace.py proves
# Fractional and large orders; 2^48 (1 - 2^-53) and 2^48 fall in different groups of the
# series (48 binades each), 1 + 2^-52 is the smallest order above 1.
LAPLACE_EDGE_ORDERS = np.array(
    [
        1 + 2.0**-52,
        1.01,
        1.5,
        2.0,
        10.5,
        63.0,
        1024.0,
        1e5,
        2.0**48 * (1 - 2.0**-53),
        2.0**48,
        1e300,
    ]
)


def laplace_edge_epsilons():
    """For every order: eps0 one ulp either side of r = a eps0 = 1 (series / expm1 - x)
    and of x1 = (a-1) eps0 = 8 (expm1 - x / factored form), and x1 = 699 (where a times
    e^x1 overflowed once); then tiny eps0 (subnormal curves) and huge ones."""
    edges = []
    for order in LAPLACE_EDGE_ORDERS:
        for target in (1.0 / order, 8.0 / (order - 1.0)):
            edges += [np.nextafter(target, 0.0), target, np.nextafter(target, np.inf)]
        edges.append(699.0 / (order - 1.0))
    return np.array(edges + [5e-324, 1e-310, 1e-200, 1e-160, 1e-20, 3e-9, 0.3, 1e3, 1e300])


def assert_laplace_within_bound(value, order, epsilon0):
    exact = mp_oracles.laplace_rdp(float(order), float(epsilon0))
    if exact >= 2.0**-1022:
        error = (mp_oracles.mp.mpf(float(value)) - exact) / exact
        assert abs(error) <= LAPLACE_BOUND, (order, epsilon0, value, exact)
    else:  # subnormal: at or above exact, by at most the 2^-1073 added and 2^-1074 rounding
        assert exact <= value <= exact + 2.0**-1072, (order, epsilon0, value, exact)


def test_laplace_curve_within_its_bound_at_region_edges():
    epsilons = laplace_edge_epsilons()
    batched = LaplaceMechanism.curves([LaplaceMechanism(e) for e in epsilons], LAPLACE_EDGE_ORDERS)
    with np.errstate(over="ignore"):
        r = epsilons[:, None] * LAPLACE_EDGE_ORDERS
        x1 = epsilons[:, None] * (LAPLACE_EDGE_ORDERS - 1.0)
    for region in (r < 1.0, (r >= 1.0) & (x1 < 8.0), x1 >= 8.0):  # every region reached
        assert region.any(axis=0).all()
    for row, epsilon0 in enumerate(epsilons):
        single = LaplaceMechanism(epsilon0).rdp(LAPLACE_EDGE_ORDERS)
        for column, order in enumerate(LAPLACE_EDGE_ORDERS):
            assert_laplace_within_bound(batched[row, column], order, epsilon0)
            assert_laplace_within_bound(single[column], order, epsilon0)


@settings(max_examples=60, deadline=None)
@given(st.floats(-28.0, 7.0), st.floats(1e-6, 14.0))
def test_laplace_curve_within_its_bound_anywhere(log_epsilon0, log_order_excess):
    epsilon0, order = math.exp(log_epsilon0), 1.0 + math.expm1(log_order_excess)
    assert_laplace_within_bound(
        LaplaceMechanism(epsilon0).rdp(np.array([order]))[0], order, epsilon0
    )


@pytest.mark.parametrize("z", [1e-200, 1e-160, 1e154, 1e300])
def test_extreme_noise_multipliers_cost_a_bound_not_an_exception(z):
    # Never below the exact cost beyond the last ulps CURVE_ROUNDING covers, not even by
    # underflow; +inf where the exact cost is beyond every double.
    mechanism = GaussianMechanism(z)
    inverse_square = 1 / mp_oracles.mp.mpf(z) ** 2
    assert mechanism.zcdp_rho >= inverse_square / 2 * (1 - CURVE_ROUNDING / 4)
    assert mechanism.mu_squared(3) >= 3 * inverse_square * (1 - CURVE_ROUNDING / 4)
    assert mechanism.zcdp_rho > 0.0


# Mechanisms whose loss vanishes below the doubles, with their exact total-variation
# distance (the smallest delta at which eps 0 would be true): randomised response's
# tanh(eps0 / 2), and q times the Gaussian's 2 Phi(1 / (2 z)) - 1 for the subsampled one.
VANISHING = [
    (PureDPMechanism(1e-170), lambda: mp_oracles.mp.tanh(mp_oracles.mp.mpf(1e-170) / 2)),
    (PureDPMechanism(1e-300), lambda: mp_oracles.mp.tanh(mp_oracles.mp.mpf(1e-300) / 2)),
    (
        PoissonSubsampledGaussianMechanism(1e200, 0.5),
        lambda: mp_oracles.mp.mpf(0.5) * mp_oracles.mp.erf(1 / (2 * mp_oracles.mp.sqrt(2) * 1e200)),
    ),
    (
        PoissonSubsampledGaussianMechanism(1e200, 1.0),
        lambda: mp_oracles.mp.erf(1 / (2 * mp_oracles.mp.sqrt(2) * 1e200)),
    ),
]


@pytest.mark.parametrize(
    ("mechanism", "total_variation"), VANISHING, ids=[str(m) for m, _ in VANISHING]
)
def test_a_vanishing_loss_is_never_epsilon_zero(mechanism, total_variation):
    """Its curve underflowed to all zeros, which reads as "nothing released" (eps 0) even at
    a delta below the mechanism's total-variation distance: a false (0, delta) claim."""
    curve = mechanism.rdp(DEFAULT_ORDERS)
    assert (curve > 0.0).all()
    accountant = RDPAccountant()
    accountant.compose(mechanism)
    with mp_oracles.mp.workdps(mp_oracles.DIGITS):
        delta = float(total_variation() / 10)
    assert delta > 0.0
    assert accountant.get_epsilon(delta)[0] > 0.0


@pytest.mark.parametrize("eps0", [1e-170, 1e-160, 1e-155, 5e-324])
def test_a_vanishing_pure_dp_curve_bounds_the_exact_one(eps0):
    """Below the normal range the curve keeps no relative precision; raised, it stays at or
    above the exact randomised-response divergence at every order, near 1 too."""
    orders = np.array([1.001, 1.1, 1.5, 2.0, 3.0, 32.0, 256.0, 1024.0])
    for order, value in zip(orders, PureDPMechanism(eps0).rdp(orders), strict=True):
        exact = mp_oracles.randomised_response_rdp(float(order), eps0)
        assert value >= exact, (order, value, exact)


@pytest.mark.parametrize(("z", "q"), [(1e200, 0.5), (1e160, 0.5), (1e156, 0.01), (1e155, 1.0)])
def test_a_vanishing_subsampled_gaussian_curve_bounds_the_exact_one(z, q):
    """z beyond ~1.3e154 made 2 z^2 overflow and the curve 0, though the exact one is up to
    ~1e-308 there: at every integer order ours is at or above the exact binomial sum."""
    orders = np.array([2.0, 3.0, 8.0, 64.0, 256.0])
    curve = PoissonSubsampledGaussianMechanism(z, q).rdp(orders)
    for order, value in zip(orders, curve, strict=True):
        exact = mp_oracles.subsampled_gaussian_rdp_binomial(z, q, int(order))
        assert value > 0.0 and value >= exact, (order, value, exact)
