"""The noise's standard deviation a release publishes: against mpmath sums of the discrete
distributions' own mass functions, and against the samplers that draw the noise."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.accounting.noise import sample_discrete_gaussian, sample_discrete_laplace
from dp_budget_provider.accounting.release import plan_noise
from dp_budget_provider.accounting.spread import (
    discrete_gaussian_std,
    discrete_laplace_std,
    gaussian_std,
    laplace_std,
)
from tests.accounting.mp_oracles import mp_discrete_std


@pytest.mark.parametrize("sigma", [0.2, 0.5, 1.0, 2.5, 5.99, 6.0, 17.0, 300.0])
def test_the_discrete_gaussian_std_is_its_mass_functions(sigma):
    expected = mp_discrete_std(lambda y: mpmath.exp(-(y**2) / (2 * mpmath.mpf(sigma) ** 2)), sigma)
    assert discrete_gaussian_std(sigma) == pytest.approx(expected, rel=1e-12)
    # Canonne-Kamath-Steinke: at most the continuous sigma.
    assert discrete_gaussian_std(sigma) <= sigma * (1 + 1e-15)


@pytest.mark.parametrize("scale", [0.1, 0.5, 1.0, 3.0, 40.0, 500.0])
def test_the_discrete_laplace_std_is_its_mass_functions(scale):
    expected = mp_discrete_std(lambda y: mpmath.exp(-y / mpmath.mpf(scale)), scale)
    assert discrete_laplace_std(scale) == pytest.approx(expected, rel=1e-12)


def test_the_continuous_spreads():
    assert gaussian_std(3.0) == 3.0
    assert laplace_std(2.0) == pytest.approx(2 * math.sqrt(2), rel=1e-15)


@pytest.mark.parametrize(
    ("draw", "std", "parameter"),
    [
        (sample_discrete_gaussian, discrete_gaussian_std, 0.7),
        (sample_discrete_laplace, discrete_laplace_std, 1.3),
    ],
)
def test_the_std_is_that_of_the_noise_the_samplers_draw(draw, std, parameter):
    # 200000 draws: the sample std is within 1% of the true one (its own sd is ~0.2-0.3%).
    sample = draw(parameter, 200_000, seed=7).astype(np.float64)
    assert sample.std() == pytest.approx(std(parameter), rel=0.01)


def test_a_plan_states_the_std_of_its_noise_in_the_answers_units():
    counts = plan_noise(LaplaceMechanism(0.5), l1_sensitivity=1.0, granularity=1)
    assert counts.noise_std == pytest.approx(discrete_laplace_std(2.0))  # scale 2, 1 unit
    fine = plan_noise(GaussianMechanism(4.0), l2_sensitivity=1.0)  # lattice 2**-8
    assert fine.granularity == 2**-8
    assert fine.noise_std == pytest.approx(4.0, rel=1e-12)  # 1024 units: sigma itself
    floating = plan_noise(LaplaceMechanism(0.5), l1_sensitivity=1.0, noise="unsafe_float")
    assert floating.noise_std == pytest.approx(2.0 * math.sqrt(2))
