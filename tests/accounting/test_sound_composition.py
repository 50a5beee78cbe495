"""Composition is sound to the last bit, for any number of releases (rounding.py).

Plain float addition rounds to nearest, so a long composition can hold less than the
exact sum of its releases' costs. The releases here are chosen so that it would round
*down* at every step: two releases of 2^53 invocations come first, after which each
release adds less than half an ulp of the running sum at every order, which a plain
``+=`` drops entirely. The exact sums are rational (every double is a dyadic rational)
and are grouped by distinct mechanism, so tens of thousands of releases cost a few
hundred Fraction operations. The epsilons are compared with the conversions of the
exact curve evaluated in mpmath.
"""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

import mpmath as mp
import numpy as np
import pytest

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    GaussianMechanism,
    LaplaceMechanism,
    PoissonSubsampledGaussianMechanism,
    PureDPMechanism,
    RDPAccountant,
    ZCDPMechanism,
)
from dp_budget_provider.accounting.rounding import dot_up
from tests.accounting import mp_oracles

BIG = 2**53
DELTA = 1e-6
# Curves around 1e-17 at small orders: 2^54 invocations of each make a curve of order 1.
MECHANISMS = (
    GaussianMechanism(2.1e8),
    ZCDPMechanism(1.3e-17),
    LaplaceMechanism(4.1e-9),
    PureDPMechanism(3.7e-9),
    PoissonSubsampledGaussianMechanism(1.0, 3.1e-9),
)
# How often each follows the two large releases: mostly the cheap-to-compose ones.
WEIGHTS = (2, 1, 1, 2, 4)


def exact_sums(releases, orders):
    """(rho, residual per order) of ``releases`` in rational arithmetic: the exact sums of
    the float costs each mechanism reports."""
    counts: Counter = Counter()
    for mechanism, count in releases:
        counts[mechanism] += count
    rho, residual = Fraction(0), [Fraction(0)] * orders.size
    for mechanism, count in counts.items():
        if mechanism.zcdp_rho is not None:
            rho += count * Fraction(mechanism.zcdp_rho)
        else:
            curve = mechanism.rdp(orders)
            residual = [
                r + count * Fraction(float(c)) for r, c in zip(residual, curve, strict=True)
            ]
    return rho, residual


def exact_epsilon(orders, rho, residual, conversion):
    """min over the grid of the conversion of the exact curve, at 60 digits."""
    with mp.workdps(mp_oracles.DIGITS):
        best = mp.inf
        for order, part in zip(orders.tolist(), residual, strict=True):
            a = mp.mpf(order)
            curve = mp.mpf(rho.numerator) / rho.denominator * a
            curve += mp.mpf(part.numerator) / part.denominator
            if conversion == "classic":
                eps = curve + mp.log(1 / mp.mpf(DELTA)) / (a - 1)
            elif order > 1.01:
                eps = curve + mp.log1p(-1 / a) - (mp.log(DELTA) + mp.log(a)) / (a - 1)
            else:
                continue
            best = min(best, eps)
        return best


def adversarial_releases(count, seed, most=1):
    """Two releases of 2^53 invocations of every mechanism, then ``count`` releases of 1 to
    ``most`` invocations."""
    rng = random.Random(seed)
    tail = [(m, rng.randint(1, most)) for m in rng.choices(MECHANISMS, WEIGHTS, k=count)]
    return [(m, BIG) for m in MECHANISMS for _ in range(2)] + tail


def assert_holds_at_least_the_exact_sums(accountant, releases):
    rho, residual = exact_sums(releases, accountant.orders)
    state = accountant.state()
    assert Fraction(state.rho) >= rho
    below = [j for j, r in enumerate(residual) if Fraction(state.residual[j]) < r]
    assert not below, f"residual below the exact sum at orders {accountant.orders[below]}"
    for conversion in ("improved", "classic"):
        reported = accountant.epsilon_bound(DELTA, conversion).epsilon
        assert reported >= exact_epsilon(accountant.orders, rho, residual, conversion)


def test_one_by_one_composition_never_holds_less_than_the_exact_sum():
    releases = adversarial_releases(30_000, seed=1)
    accountant = RDPAccountant()
    for mechanism, count in releases:
        accountant.compose(mechanism, count)
    assert_holds_at_least_the_exact_sums(accountant, releases)
    # The excess is what the bound costs: a few ulps per addition, far below 1e-9.
    rho, _ = exact_sums(releases, accountant.orders)
    assert float((Fraction(accountant.state().rho) - rho) / rho) < 1e-10


@pytest.mark.parametrize("chunk", [1_000, 100_000])
def test_batched_composition_never_holds_less_than_the_exact_sum(chunk):
    releases = adversarial_releases(100_000, seed=chunk, most=3)
    accountant = RDPAccountant()
    for start in range(0, len(releases), chunk):
        accountant.compose_many(releases[start : start + chunk])
    assert_holds_at_least_the_exact_sums(accountant, releases)


def test_gaussian_only_composition_keeps_mu_squared_and_the_exact_bound_above_exact():
    rng = random.Random(3)
    zs = [2.1e8, 3.3e8, 1.7e8]
    releases = [(GaussianMechanism(z), BIG) for z in zs for _ in range(2)]
    releases += [(GaussianMechanism(rng.choice(zs)), rng.randint(1, 2)) for _ in range(20_000)]
    accountant = RDPAccountant()
    for mechanism, count in releases:
        accountant.compose(mechanism, count)
    terms = Counter(mechanism.mu_squared(count) for mechanism, count in releases)
    assert Fraction(accountant.gaussian_mu_squared) >= sum(
        times * Fraction(term) for term, times in terms.items()
    )
    bound = accountant.epsilon_bound(DELTA)
    assert bound.method == "analytic-gaussian"
    exact_mu_squared = sum(
        Fraction(count) / Fraction(m.noise_multiplier) ** 2 for m, count in releases
    )
    with mp.workdps(mp_oracles.DIGITS):
        mu = mp.sqrt(mp.mpf(exact_mu_squared.numerator) / exact_mu_squared.denominator)
        assert mp_oracles.gaussian_delta(bound.epsilon, mu) <= DELTA


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_dot_up_bounds_the_exact_dot_product(n):
    rng = np.random.default_rng(n)
    counts = rng.integers(1, 2**53, size=n, endpoint=True)
    values = rng.random((n, 5)) * 10.0 ** rng.integers(-320, 290, size=(n, 5))
    bound = dot_up(counts, values)
    for j in range(5):
        exact = sum(int(c) * Fraction(float(v)) for c, v in zip(counts, values[:, j], strict=True))
        assert Fraction(float(bound[j])) >= exact


def test_dot_up_of_one_single_cost_is_exact():
    curve = LaplaceMechanism(0.3).rdp(DEFAULT_ORDERS)
    assert np.array_equal(dot_up(np.array([1]), curve[None, :]), curve)
