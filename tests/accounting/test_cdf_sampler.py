"""The certified-table samplers: exact pmf at 10**6 draws, exact refinement, certified bounds."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from dp_budget_provider.accounting import cdf_sampler as C
from dp_budget_provider.accounting.secure_random import SeededTestRandom
from tests.accounting.test_noise import P_MIN, binned_chisquare, dgauss_pmf, dlap_pmf


@pytest.mark.parametrize("x", [Fraction(0), Fraction(1, 3), Fraction(1, 2**21), Fraction(7, 2)])
def test_exp_bounds_bracket_exp(x: Fraction) -> None:
    lo, hi = C.exp_neg_bounds(x, 80)
    assert lo <= hi <= lo + 2
    assert lo / 2**80 <= math.exp(-x) * (1 + 1e-15) and hi / 2**80 >= math.exp(-x) * (1 - 1e-15)


@pytest.mark.parametrize(
    ("kind", "spread", "seed"),
    [("gaussian", 1536.0, 1), ("laplace", 1536.0, 2), ("gaussian", 3.7, 3)],
)
def test_table_sampler_matches_exact_pmf_at_a_million_draws(kind, spread, seed) -> None:
    parameter = Fraction(spread) ** 2 if kind == "gaussian" else Fraction(spread)
    sampler = C.sampler_for(kind, parameter)
    samples = sampler.sample(10**6, SeededTestRandom(seed))
    if kind == "gaussian":
        ys, p = dgauss_pmf(spread**2, math.ceil(13 * spread) + 10)
    else:
        ys, p = dlap_pmf(spread, math.ceil(60 * spread) + 10)
    assert binned_chisquare(samples, ys, p) > P_MIN


def test_chi_square_detects_a_table_one_percent_too_wide() -> None:
    sampler = C.sampler_for("gaussian", Fraction(1536 * 1.01) ** 2)
    samples = sampler.sample(10**6, SeededTestRandom(4))
    assert binned_chisquare(samples, *dgauss_pmf(1536.0**2, 20_000)) < P_MIN


def test_straddling_prefixes_are_refined_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 6 bits many draws straddle a bound: the refinement decides them, still exactly."""
    sampler = C.CdfSampler(C.Family("gaussian", Fraction(9, 4)), bits=6)
    calls = []
    real = sampler._refine
    monkeypatch.setattr(sampler, "_refine", lambda *a: calls.append(1) or real(*a))
    samples = sampler.sample(200_000, SeededTestRandom(5))
    assert len(calls) > 1000
    assert binned_chisquare(samples, *dgauss_pmf(9 / 4, 40)) > P_MIN


def test_bounds_are_certified_against_a_high_precision_cdf() -> None:
    """lo <= 2**bits P(M <= k) <= hi, checked with 200-bit bounds of the same CDF."""
    family = C.Family("laplace", Fraction(5, 2))
    lo, hi = C.cdf_bounds(family, 20)
    fine_lo, fine_hi = C.cdf_bounds(family, 200)
    for k in range(len(lo)):
        assert lo[k] << 180 <= fine_hi[k] and fine_lo[k] <= hi[k] << 180
        assert hi[k] - lo[k] <= 2


def test_long_tables_are_left_to_the_rejection_samplers() -> None:
    assert C.sampler_for("gaussian", Fraction(10**6) ** 2) is None
    assert C.sampler_for("laplace", Fraction(10**5)) is None
    assert C.sampler_for("laplace", Fraction(10**3)) is not None
