"""The exact Gaussian searches: Newton + guarded bisection replay vs. plain bisection.

``gaussian_epsilon`` and ``calibrate_analytic_gaussian`` used to bisect ~60 times on
``gaussian_delta``. They now locate the root by Newton and evaluate ``delta`` only at
the bisection probes near it. These tests pin that down against verbatim copies of
the old bisections: same floats, still feasible, still tight, same edge cases.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_budget_provider.accounting import analytic_gaussian as ag
from dp_budget_provider.accounting import (
    calibrate_analytic_gaussian,
    gaussian_delta,
    gaussian_epsilon,
)
from tests.accounting import mp_oracles


def bisection_epsilon(mu, delta):
    """The pre-Newton ``gaussian_epsilon``, verbatim: the reference for bit-identity."""
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gaussian_delta(hi, mu) > delta:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        if gaussian_delta(mid, mu) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def bisection_calibration(epsilon, delta, l2_sensitivity=1.0):
    """The pre-Newton ``calibrate_analytic_gaussian``, verbatim."""
    lo, hi = 0.0, 1.0
    while gaussian_delta(epsilon, hi) <= delta:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        if gaussian_delta(epsilon, mid) <= delta:
            lo = mid
        else:
            hi = mid
    if lo == 0.0:
        raise ValueError(f"no Gaussian noise level reaches eps={epsilon}, delta={delta}")
    return math.nextafter(l2_sensitivity / lo, math.inf)


def log_uniform(rng, low, high, size):
    return np.exp(rng.uniform(math.log(low), math.log(high), size)).tolist()


def seeded_pairs(seed, size, mu_range=(1e-4, 50.0), delta_range=(1e-12, 0.5)):
    rng = np.random.default_rng(seed)
    mus = log_uniform(rng, *mu_range, size)
    return list(zip(mus, log_uniform(rng, *delta_range, size), strict=True))


def assert_sound_and_tight(eps, mu, delta):
    assert gaussian_delta(eps, mu) <= delta  # never below the true loss...
    if eps > 0.0:  # ...and the float just below is infeasible
        assert gaussian_delta(math.nextafter(eps, 0.0), mu) > delta


@pytest.mark.parametrize("seed", [0, 1])
def test_bit_identical_to_bisection_on_a_seeded_grid(seed):
    # mu from 1e-4 (delta cancels over thousands of ulps of eps) to 50 (eps ~ 1e3).
    for mu, delta in seeded_pairs(seed, 150):
        eps = gaussian_epsilon(mu, delta)
        assert eps == bisection_epsilon(mu, delta), (mu, delta)
        assert_sound_and_tight(eps, mu, delta)


@settings(max_examples=150, deadline=None)
@given(
    st.floats(1e-4, 20.0),
    st.one_of(st.floats(1e-12, 0.5), st.sampled_from([1e-5, 1e-6, 1e-9, 0.5 - 1e-12])),
)
def test_bit_identical_to_bisection_property(mu, delta):
    eps = gaussian_epsilon(mu, delta)
    assert eps == bisection_epsilon(mu, delta)
    assert_sound_and_tight(eps, mu, delta)


@pytest.mark.parametrize(
    ("mu", "delta"),
    [
        (math.sqrt(37) / 1000, 1e-5),  # the ledger's typical account
        (1e-8, 1e-12),  # tiny mu: delta(0) ~ 4e-9 only just above the target
        (1e-4, 1e-300),  # far-tail delta
        (5.0, 0.999),  # delta close to 1
        (5.0, 1.0 - 1e-12),
        (40.0, 1e-12),  # log_ndtr's asymptotic branch on every probe
        (3000.0, 1e-5),  # large mu, still on the fast path
        (2e4, 1e-5),  # beyond the fast path: the reference runs
    ],
)
def test_edge_cases_match_bisection(mu, delta):
    eps = gaussian_epsilon(mu, delta)
    assert eps == bisection_epsilon(mu, delta)
    assert gaussian_delta(eps, mu) <= delta


# (1e-200, 1e-300) was here: the exact delta(0) is 4e-201, so eps = 0 under-counted.
@pytest.mark.parametrize(("mu", "delta"), [(1e-3, 0.5), (1e-200, 1e-5), (0.5, 0.9)])
def test_zero_epsilon_when_delta_at_zero_already_fits(mu, delta):
    assert gaussian_delta(0.0, mu) <= delta
    assert gaussian_epsilon(mu, delta) == 0.0


def test_huge_mu_keeps_the_reference_behaviour():
    # eps ~ mu^2 / 2 overflows the doubling; the reference's validation error is kept.
    with pytest.raises(ValueError, match="epsilon must be finite"):
        gaussian_epsilon(1e160, 1e-5)


@pytest.mark.parametrize(
    ("mu", "delta", "name"),
    [
        (0.0, 1e-5, "mu"),
        (-1.0, 1e-5, "mu"),
        (float("nan"), 1e-5, "mu"),
        (float("inf"), 1e-5, "mu"),
        (True, 1e-5, "mu"),
        ("1", 1e-5, "mu"),
        (1.0, 0.0, "delta"),
        (1.0, 1.0, "delta"),
        (1.0, float("nan"), "delta"),
        (1.0, -1e-5, "delta"),
    ],
)
def test_validation_errors_unchanged(mu, delta, name):
    with pytest.raises(ValueError, match=name):
        gaussian_epsilon(mu, delta)


@pytest.mark.parametrize(("epsilon", "mu", "name"), [(-1.0, 1.0, "epsilon"), (1.0, 0.0, "mu")])
def test_gaussian_delta_still_validates(epsilon, mu, name):
    with pytest.raises(ValueError, match=name):
        gaussian_delta(epsilon, mu)


def test_derivative_in_eps_is_minus_the_second_term():
    # d delta / d eps = -e^eps Phi(-eps/mu - mu/2), the slope the Newton stage uses.
    for mu, eps in [(0.3, 0.5), (2.0, 3.0), (8.0, 40.0)]:
        step = 1e-6 * eps
        numeric = (gaussian_delta(eps + step, mu) - gaussian_delta(eps - step, mu)) / (2 * step)
        _, second, _ = ag._curve(eps, mu)
        assert numeric == pytest.approx(-second, rel=1e-6)


def test_derivative_in_mu_is_the_normal_density():
    # d delta / d mu = phi(-eps/mu + mu/2), the slope of the calibration's Newton stage.
    for eps, mu in [(0.5, 0.3), (3.0, 2.0), (40.0, 8.0)]:
        step = 1e-6 * mu
        numeric = (gaussian_delta(eps, mu + step) - gaussian_delta(eps, mu - step)) / (2 * step)
        a = -eps / mu + mu / 2
        assert numeric == pytest.approx(math.exp(-a * a / 2) / math.sqrt(2 * math.pi), rel=1e-6)


def count_delta_evaluations(monkeypatch):
    calls = [0]
    inner = ag._delta

    def counted(epsilon, mu):
        calls[0] += 1
        return inner(epsilon, mu)

    monkeypatch.setattr(ag, "_delta", counted)
    return calls


@pytest.mark.parametrize(
    ("mu", "delta"), [(math.sqrt(37) / 1000, 1e-5), (0.5, 1e-5), (5.0, 1e-5), (30.0, 1e-12)]
)
def test_few_exact_delta_evaluations(monkeypatch, mu, delta):
    # The bisection evaluated delta ~60 times; the replay only inside the guard band.
    calls = count_delta_evaluations(monkeypatch)
    gaussian_epsilon(mu, delta)
    assert calls[0] <= 25


def test_reference_fallback_when_the_estimate_is_wrong(monkeypatch):
    # A wrong Newton estimate with a too narrow guard makes the replay infer wrong sides;
    # the end-of-search check catches it and the plain bisection answers instead.
    mu, delta = 0.5, 1e-5
    truth = bisection_epsilon(mu, delta)
    monkeypatch.setattr(ag, "_estimate_epsilon", lambda *_: (1.5 * truth, 1e-12))
    assert gaussian_epsilon(mu, delta) == truth
    monkeypatch.setattr(ag, "_estimate_epsilon", lambda *_: (0.5 * truth, 1e-12))
    assert gaussian_epsilon(mu, delta) == truth


def test_calibration_fallback_when_the_estimate_is_wrong(monkeypatch):
    truth = bisection_calibration(1.0, 1e-5)
    mu = 1.0 / truth
    for wrong in (0.5 * mu, 2.0 * mu):
        monkeypatch.setattr(ag, "_estimate_mu", lambda *_, wrong=wrong: (wrong, 1e-12))
        assert calibrate_analytic_gaussian(1.0, 1e-5) == truth


def test_soundness_does_not_depend_on_the_error_model(monkeypatch):
    # With no guard at all (every probe near the root decided by the estimate's side) the
    # answer is still feasible and locally tight, because the final ends are checked.
    monkeypatch.setattr(ag, "_GUARD_FACTOR", 0.0)
    monkeypatch.setattr(ag, "_GUARD_ULPS", 0.0)
    for mu, delta in seeded_pairs(2, 60, mu_range=(1e-4, 5.0)):
        assert_sound_and_tight(gaussian_epsilon(mu, delta), mu, delta)


@pytest.mark.parametrize("seed", [0, 1])
def test_calibration_bit_identical_to_bisection(seed):
    rng = np.random.default_rng(seed)
    epsilons = log_uniform(rng, 1e-3, 50.0, 100)
    deltas = log_uniform(rng, 1e-12, 0.5, 100)
    for eps, delta in zip(epsilons, deltas, strict=True):
        sigma = calibrate_analytic_gaussian(eps, delta, l2_sensitivity=2.0)
        assert sigma == bisection_calibration(eps, delta, l2_sensitivity=2.0), (eps, delta)
        mu = ag._calibrated_mu(eps, delta)
        assert gaussian_delta(eps, mu) <= delta  # the largest feasible mu...
        assert gaussian_delta(eps, math.nextafter(mu, math.inf)) > delta  # ...to the ulp


@pytest.mark.parametrize(
    ("eps", "delta"),
    [(1e-70, 1e-5), (1e-70, 1e-70), (1e-3, 1e-300), (0.5, 0.9999), (1e3, 1e-5), (1e6, 1e-5)],
)
def test_calibration_edge_cases_match_bisection(eps, delta):
    try:
        expected = bisection_calibration(eps, delta)
    except ValueError:  # (1e-70, 1e-70): delta's rounding cannot be certified below 1e-70
        with pytest.raises(ValueError, match="no Gaussian noise level"):
            calibrate_analytic_gaussian(eps, delta)
        return
    assert calibrate_analytic_gaussian(eps, delta) == expected


def test_calibration_validation_errors_unchanged():
    for args, name in [
        ((0.0, 1e-5), "epsilon"),
        ((1.0, 1.0), "delta"),
        ((1.0, 1e-5, -2.0), "l2_sensitivity"),
    ]:
        with pytest.raises(ValueError, match=name):
            calibrate_analytic_gaussian(*args)


# ------------------------------------------------- exact arithmetic (mpmath, 60 digits)


def mpmath_cases(seed, n, mu_range=(1e-5, 50.0), delta_range=(1e-14, 0.1)):
    rng = np.random.default_rng(seed)
    return zip(log_uniform(rng, *mu_range, n), log_uniform(rng, *delta_range, n), strict=True)


def test_delta_is_never_below_the_exact_delta():
    rng = np.random.default_rng(11)
    for mu, delta in mpmath_cases(10, 150):
        root = gaussian_epsilon(mu, delta)
        for epsilon in (0.0, root, root * float(np.exp(rng.uniform(-0.05, 0.05)))):
            exact = mp_oracles.gaussian_delta(epsilon, mu)
            assert gaussian_delta(epsilon, mu) >= exact, (epsilon, mu)


def test_epsilon_is_never_below_the_exact_epsilon():
    # gaussian_epsilon's answer satisfies the exact curve: exact delta(eps) <= delta.
    for mu, delta in [*mpmath_cases(12, 200), (1e-4, 1e-10), (1e-8, 1e-12), (3.0, 1e-300)]:
        epsilon = gaussian_epsilon(mu, delta)
        assert mp_oracles.gaussian_delta(epsilon, mu) <= delta, (mu, delta)


def test_calibration_is_never_below_the_exact_sigma():
    rng = np.random.default_rng(13)
    epsilons, deltas = log_uniform(rng, 1e-3, 20.0, 200), log_uniform(rng, 1e-12, 1e-2, 200)
    for epsilon, delta in zip(epsilons, deltas, strict=True):
        sigma = calibrate_analytic_gaussian(epsilon, delta, l2_sensitivity=2.0)
        exact = mp_oracles.gaussian_delta(epsilon, 2.0 / mp_oracles.mp.mpf(sigma))
        assert exact <= delta, (epsilon, delta)


def test_huge_mu_gives_an_answer_not_an_overflow():
    from dp_budget_provider.accounting import GaussianMechanism, RDPAccountant

    epsilon = gaussian_epsilon(1e20, 1e-10)  # OverflowError before
    assert mp_oracles.gaussian_delta(epsilon, 1e20) <= 1e-10
    accountant = RDPAccountant()
    accountant.compose(GaussianMechanism(1e-9), 3)
    bound = accountant.epsilon_bound(1e-5)
    assert math.isfinite(bound.epsilon)
