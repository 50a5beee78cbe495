"""Error bars: the standard deviation and the interval half-width of the noise a release
draws, against mpmath sums of the discrete distributions' own mass functions; the
interval's coverage over the real sampler's draws; and ``accuracy``'s noise multiplier
(within the error, and the largest that is)."""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import mpmath as mp
import numpy as np
import pytest

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.accounting.error_bars import (
    check_confidence,
    error_bars,
    gaussian_half_width_units,
    half_width,
    laplace_half_width_units,
    least_noise_within,
)
from dp_budget_provider.accounting.release import plan_noise
from tests.accounting.mp_oracles import mp_discrete_std

LEVELS = (0.5, 0.9, 0.95, 0.99)


@functools.lru_cache(maxsize=16)
def gaussian_mass(sigma2: Fraction):
    """P(|Y| <= q) of the discrete Gaussian, by mpmath sums (40 digits) out to 40 sigma
    (beyond: below exp(-800) of the mass)."""
    s2 = mp.mpf(sigma2.numerator) / sigma2.denominator
    reach = math.ceil(40 * math.sqrt(float(sigma2))) + 2
    weights = [mp.exp(-(mp.mpf(y) ** 2) / (2 * s2)) for y in range(reach)]
    total = 2 * mp.fsum(weights) - 1
    return lambda q: (2 * mp.fsum(weights[: q + 1]) - 1) / total if q >= 0 else mp.mpf(0)


def laplace_mass(scale: Fraction):
    """P(|Y| <= q) of the discrete Laplace in 40 digits: the geometric sums 1 + 2 sum p^y
    in closed form, ``(1 + p - 2 p^(q+1)) / (1 + p)``, p = exp(-1/t)."""
    t = mp.mpf(scale.numerator) / scale.denominator
    p = mp.exp(-1 / t)
    return lambda q: (1 + p - 2 * p ** (q + 1)) / (1 + p) if q >= 0 else mp.mpf(0)


def assert_least_covering(q: int, covered, level: float) -> None:
    """P(|Y| <= q) >= level and P(|Y| <= q - 1) < level, to 40 digits."""
    assert covered(q) >= level
    assert covered(q - 1) < level


@pytest.mark.parametrize("sigma", ["1/3", "1", "7/2", "50", "300"])
@pytest.mark.parametrize("level", LEVELS)
def test_the_gaussian_half_width_is_the_least_that_covers(sigma, level):
    sigma2 = Fraction(sigma) ** 2  # on the sampler's table: its parameter is sigma^2
    with mp.workdps(40):
        assert_least_covering(
            gaussian_half_width_units(sigma2, level), gaussian_mass(sigma2), level
        )


@pytest.mark.parametrize("scale", ["1/2", "3", "40", "20000"])
@pytest.mark.parametrize("level", LEVELS)
def test_the_laplace_half_width_is_the_least_that_covers(scale, level):
    t = Fraction(scale)
    with mp.workdps(40):
        assert_least_covering(laplace_half_width_units(t, level), laplace_mass(t), level)


@pytest.mark.parametrize("sigma", [3e4, 1e6, 2.0**39])
def test_past_the_tables_the_gaussian_half_width_covers_within_a_unit(sigma):
    """Past the sampler's tables the tail is bounded, not summed: the half-width covers
    (exact tail by Euler-Maclaurin in mpmath; the normaliser is sqrt(2 pi) s to far below
    the digits kept) and is at most one unit above the least, plus what the margin on
    erfc costs (a relative 1e-11 of sigma)."""
    sigma2 = Fraction(sigma) ** 2
    q = gaussian_half_width_units(sigma2, 0.95)
    with mp.workdps(30):
        s = mp.sqrt(mp.mpf(sigma2.numerator) / sigma2.denominator)

        def tail(k: int) -> mp.mpf:  # P(|Y| > k)
            head = s * mp.sqrt(mp.pi / 2) * mp.erfc((k + 0.5) / (s * mp.sqrt(2)))
            # midpoint rule's error: sum = integral - w'(k + 1/2)/24 + O(w'''), tiny here
            slope = (k + 0.5) / s**2 * mp.exp(-((k + 0.5) ** 2) / (2 * s**2))
            return 2 * (head - slope / 24) / (mp.sqrt(2 * mp.pi) * s)

        assert tail(q) <= 0.05
        assert tail(q - 2 - math.ceil(1e-11 * sigma)) > 0.05


@pytest.mark.parametrize(
    ("mechanism", "sensitivity"),
    [
        (GaussianMechanism(0.4), {"l2_sensitivity": 1.0}),
        (LaplaceMechanism(2.0), {"l1_sensitivity": 1.0}),
    ],
)
def test_the_stddev_is_the_mass_functions_in_the_answers_units(mechanism, sensitivity):
    plan = plan_noise(mechanism, granularity=0.25, **sensitivity)
    units = float(plan.lattice.in_units(plan.spread))
    if plan.family == "gaussian":
        expected = mp_discrete_std(lambda y: mp.exp(-(y**2) / (2 * mp.mpf(units) ** 2)), units)
    else:
        expected = mp_discrete_std(lambda y: mp.exp(-y / mp.mpf(units)), units)
    bars = error_bars(plan, 0.95)
    assert bars.stddev == pytest.approx(expected * 0.25, rel=1e-12)
    assert bars.half_width % 0.25 == 0.0  # a lattice multiple
    assert bars.interval(1.0) == [1.0 - bars.half_width, 1.0 + bars.half_width]


@pytest.mark.parametrize(
    ("mechanism", "sensitivity"),
    [
        (GaussianMechanism(1.5), {"l2_sensitivity": 2.0, "granularity": 2**-8}),  # 768 units
        (LaplaceMechanism(0.8), {"l1_sensitivity": 2.0, "granularity": 2**-4}),  # 40 units
        (GaussianMechanism(0.6), {"l2_sensitivity": 1.0, "granularity": 1}),  # 0.6 units
        # past the tables (4e4 units): the half-width from the tail bound, the coverage
        # the continuous one to a relative 1e-9 (the discrete mass's Poisson summation)
        (GaussianMechanism(2.0), {"l2_sensitivity": 5.0, "granularity": 2**-12}),
    ],
)
def test_the_95_percent_interval_covers_95_percent_of_the_real_noise(mechanism, sensitivity):
    """20000 releases of 0 through the plan's own sampler (seeded): the share whose
    interval holds 0 is the interval's exact coverage (mpmath) within 5 binomial standard
    deviations (a false alarm has probability under 1e-6), and that coverage is at least
    95%; so the interval is exact, not merely wide."""
    draws = 20_000
    plan = plan_noise(mechanism, rule=AnswerRule(0.0, None, draws), **sensitivity)
    noisy = plan.noisy_array(np.zeros(draws), seed=26)
    bars = error_bars(plan, 0.95)
    inside = int(np.sum(np.abs(noisy) <= bars.half_width))
    q = round(bars.half_width / plan.granularity)
    units = plan.lattice.in_units(plan.spread)
    with mp.workdps(30):
        if plan.family == "gaussian" and units > 10**4:
            coverage = float(mp.erf((q + mp.mpf(1) / 2) / (mp.sqrt(2) * float(units))))
        elif plan.family == "gaussian":
            coverage = float(gaussian_mass(units**2)(q))
        else:
            coverage = float(laplace_mass(units)(q))
    assert coverage >= 0.95
    spread = math.sqrt(draws * coverage * (1 - coverage))
    assert abs(inside - draws * coverage) <= 5 * spread


def test_unsafe_float_noise_gets_the_continuous_quantiles():
    gaussian = plan_noise(GaussianMechanism(2.0), l2_sensitivity=1.0, noise="unsafe_float")
    assert half_width(gaussian, 0.95) == pytest.approx(2.0 * 1.959963984540054, rel=1e-12)
    laplace = plan_noise(LaplaceMechanism(0.5), l1_sensitivity=1.0, noise="unsafe_float")
    assert half_width(laplace, 0.95) == pytest.approx(2.0 * math.log(20.0), rel=1e-12)


@pytest.mark.parametrize(
    ("error", "level", "granularity"),
    [(10.0, 0.95, None), (10.0, 0.95, 1), (2.5, 0.9, 0.5), (0.3, 0.99, None)],
)
def test_accuracy_plans_the_most_noise_within_the_error(error, level, granularity):
    """The multiplier planned keeps the half-width within ``error``; one a relative 1e-9
    larger (more noise, a smaller charge) does not: it is the largest, to that tolerance."""

    def plan_for(z: float):
        return plan_noise(
            GaussianMechanism(z),
            l2_sensitivity=2.0,
            granularity=granularity,
            rule=AnswerRule(0.0, None, 4),
        )

    z = least_noise_within(error, level, plan_for)
    assert half_width(plan_for(z), level) <= error
    assert half_width(plan_for(z * (1 + 1e-9)), level) > error


def test_levels_and_errors_are_checked():
    for wrong in (0, 1, 1.5, -0.1, float("nan"), "0.9", True):
        with pytest.raises(ValueError, match="confidence"):
            check_confidence("confidence", wrong)
    plan = plan_noise(GaussianMechanism(1.0), l2_sensitivity=1.0)
    with pytest.raises(ValueError, match="error"):
        least_noise_within(0.0, 0.95, lambda z: plan)
    with pytest.raises(ValueError, match="level"):
        least_noise_within(1.0, 1.0, lambda z: plan)
