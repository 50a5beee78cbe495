"""Release plans: lattice noise is charged as the discrete mechanism, outputs have no data bits."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from dp_budget_provider.accounting import (
    GaussianMechanism,
    LaplaceMechanism,
    PureDPMechanism,
    ZCDPMechanism,
)
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.accounting.release import check_noise, plan_noise


def test_gaussian_charge_rounds_the_sensitivity_up_to_lattice_units() -> None:
    plan = plan_noise(GaussianMechanism(4.0), l2_sensitivity=0.3)
    assert plan.granularity == 2**-10  # largest power of two <= sigma / 1024 = 1.2 / 1024
    units = 308  # ceil(0.3 * 1024) = ceil(307.2)
    exact = Fraction(units) ** 2 / (2 * (Fraction(4.0) * Fraction(0.3) * 1024) ** 2)
    assert isinstance(plan.charged, ZCDPMechanism)
    assert plan.charged.rho >= exact and plan.charged.rho == pytest.approx(float(exact), rel=1e-15)
    assert plan.charged.rho > 1 / 32  # more than the continuous Gaussian at z = 4


def test_laplace_charge_on_a_declared_lattice_is_pure_dp_of_the_rounded_sensitivity() -> None:
    plan = plan_noise(LaplaceMechanism(0.5), l1_sensitivity=2.5, granularity=1)
    assert isinstance(plan.charged, PureDPMechanism)
    # 3 units of sensitivity over a scale of 5, rounded up to a float: never below 3/5
    assert Fraction(plan.charged.epsilon0) >= Fraction(3, 5)
    assert plan.charged.epsilon0 == pytest.approx(0.6, rel=1e-15)


def test_integer_counts_at_granularity_one_stay_integers() -> None:
    rule = AnswerRule(cells=3, integer=True)
    plan = plan_noise(GaussianMechanism(4.0), l2_sensitivity=1.0, granularity=1, rule=rule)
    assert plan.charged == ZCDPMechanism(rho=1 / 32)
    assert all(isinstance(v, int) for v in plan.add_noise([12, 0, 5]))


@pytest.mark.parametrize("bad", [0.1, 3, -1.0, float("nan")])
def test_granularity_must_be_a_power_of_two(bad) -> None:
    with pytest.raises(ValueError, match="granularity"):
        plan_noise(GaussianMechanism(4.0), l2_sensitivity=1.0, granularity=bad)


@pytest.mark.parametrize("retired", ["float", "discrete", "Lattice"])
def test_unknown_noise_names_the_options(retired) -> None:
    with pytest.raises(ValueError, match="'lattice'.*'unsafe_float'"):
        check_noise(retired)


def test_the_answer_rule_turns_any_numbers_into_a_release() -> None:
    plan = plan_noise(
        GaussianMechanism(4.0),
        l2_sensitivity=1.0,
        rule=AnswerRule(nan_value=1.0, bounds=(0, 8), cells=5),
    )
    out = plan.noisy_array([np.nan, np.inf, -np.inf, 10**400, 3])
    assert out.shape == (5,) and np.all(np.isfinite(out))
    with pytest.raises(TypeError, match="rectangular") as refused:
        plan.add_noise([[1, 2], [3]])
    assert "1" not in str(refused.value).replace("rows", "")


# ---------------------------------------------------------------------------------------
# The low-bits attack (Mironov 2012), replayed against our own samplers
# ---------------------------------------------------------------------------------------


def _float_laplace_could_output(output: np.ndarray, value: float, scale: float) -> np.ndarray:
    """Whether the unsafe float Laplace sampler can turn ``value`` into each ``output``.

    The sampler adds +-(-scale * log(u)) for u = (k + 1/2) 2**-53; invert it, try the
    neighbouring k, and replay the exact float operations.
    """
    noise = output - value
    k = np.floor(np.exp(-np.abs(noise) / scale) * 2.0**53 - 0.5)
    possible = np.zeros(output.shape, dtype=bool)
    for shift in range(-3, 4):
        u = (k + shift + 0.5) * 2.0**-53
        magnitude = -scale * np.log(u[(u > 0) & (u < 1)])
        replay = np.full(output.shape, np.nan)
        replay[(u > 0) & (u < 1)] = magnitude
        for signed in (replay, -replay):
            possible |= (value + signed) == output
    return possible


def _lattice_could_output(output: np.ndarray, value: float, granularity: float) -> np.ndarray:
    """The discrete noise gives every lattice point positive probability from any lattice input."""
    return (output - value) / granularity == np.round((output - value) / granularity)


def test_the_low_bits_attack_finds_the_leak_in_unsafe_float_noise() -> None:
    rule = AnswerRule(cells=3000)
    plan = plan_noise(LaplaceMechanism(1.0), l1_sensitivity=1.0, noise="unsafe_float", rule=rule)
    from_zero = plan.noisy_array(np.zeros(3000), seed=7)
    assert _float_laplace_could_output(from_zero, 0.0, 1.0).all()  # the replay is faithful
    impossible_from_one = ~_float_laplace_could_output(from_zero, 1.0, 1.0)
    assert impossible_from_one.mean() > 0.5  # most outputs name their input


@pytest.mark.parametrize("mechanism", [LaplaceMechanism(1.0), GaussianMechanism(1.0)])
def test_the_low_bits_attack_finds_nothing_in_lattice_noise(mechanism) -> None:
    rule = AnswerRule(cells=3000, integer=True)
    plan = plan_noise(mechanism, l1_sensitivity=1.0, l2_sensitivity=1.0, rule=rule)
    g = plan.granularity
    from_zero = plan.noisy_array(np.zeros(3000, dtype=np.int64), seed=8)
    from_one = plan.noisy_array(np.ones(3000, dtype=np.int64), seed=9)
    for outputs in (from_zero, from_one):
        assert _lattice_could_output(outputs, 0.0, g).all()
        assert _lattice_could_output(outputs, 1.0, g).all()  # every output fits both inputs
    # and no low bit below the lattice is ever set, whichever the input
    assert np.all(np.ldexp(from_zero, 10) == np.round(np.ldexp(from_zero, 10)))
    assert np.all(np.ldexp(from_one, 10) == np.round(np.ldexp(from_one, 10)))
