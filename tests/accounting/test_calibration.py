"""Calibration: analytic Gaussian (Balle-Wang) and the budget planner, against dp_accounting."""

import pytest
from dp_accounting import dp_event, mechanism_calibration
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant as rdp_oracle

from dp_budget_provider.accounting import (
    CalibrationInfeasible,
    GaussianMechanism,
    LaplaceMechanism,
    RDPAccountant,
    calibrate_analytic_gaussian,
    gaussian_delta,
    plan_noise_multiplier,
)


@pytest.mark.parametrize(("eps", "delta"), [(0.1, 1e-5), (1.0, 1e-5), (3.0, 1e-6), (10.0, 1e-9)])
def test_analytic_gaussian_calibration_is_tight(eps, delta):
    sigma = calibrate_analytic_gaussian(eps, delta, l2_sensitivity=2.0)
    mu = 2.0 / sigma
    assert gaussian_delta(eps, mu) <= delta  # feasible...
    assert gaussian_delta(eps, mu * (1 + 1e-9)) > delta  # ...and smallest


def test_analytic_gaussian_calibration_matches_pld_oracle():
    # dp_accounting's PLD accountant is (pessimistically) exact for one Gaussian.
    sigma = calibrate_analytic_gaussian(1.0, 1e-5)
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-5)
    pld.compose(dp_event.GaussianDpEvent(sigma))
    assert pld.get_epsilon(1e-5) == pytest.approx(1.0, abs=1e-3)


def rdp_oracle_calibration(existing, target, delta, count):
    """dp_accounting's calibration; it wants a fresh accountant, so past spend is in the event."""

    def event(z):
        planned = dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z), count)
        return dp_event.ComposedDpEvent([*existing, planned])

    return mechanism_calibration.calibrate_dp_mechanism(
        rdp_oracle.RdpAccountant,
        event,
        target,
        delta,
        bracket_interval=mechanism_calibration.LowerEndpointAndGuess(1e-2, 1.0),
        tol=1e-9,
    )


@pytest.mark.parametrize(
    ("laplace_spent", "target", "delta", "count"),
    [(0.5, 3.0, 1e-5, 1), (0.1, 2.0, 1e-6, 10), (1.0, 8.0, 1e-5, 4)],
)
def test_planner_matches_dp_accounting_on_a_mixed_account(laplace_spent, target, delta, count):
    spent = RDPAccountant()
    spent.compose(LaplaceMechanism(laplace_spent))
    ours = plan_noise_multiplier(spent, target, delta, count)
    oracle = rdp_oracle_calibration(
        [dp_event.LaplaceDpEvent(1 / laplace_spent)], target, delta, count
    )
    assert ours == pytest.approx(oracle, rel=1e-6)
    # The plan fits and the planner did not touch the account it planned for.
    trial = spent.copy()
    trial.compose(GaussianMechanism(ours), count)
    assert trial.get_epsilon(delta)[0] <= target
    assert spent.get_epsilon(delta)[0] < target


def test_planner_from_empty_single_release_equals_analytic_calibration():
    assert plan_noise_multiplier(RDPAccountant(), 1.0, 1e-5) == pytest.approx(
        calibrate_analytic_gaussian(1.0, 1e-5), rel=1e-8
    )


def test_planner_uses_the_exact_gaussian_bound_and_beats_rdp_calibration():
    spent = RDPAccountant()
    spent.compose(GaussianMechanism(5.0), 3)
    ours = plan_noise_multiplier(spent, 2.0, 1e-5, count=5)
    oracle = rdp_oracle_calibration([dp_event.GaussianDpEvent(5.0)] * 3, 2.0, 1e-5, 5)
    assert ours < oracle  # less noise for the same, still sound, guarantee
    assert plan_noise_multiplier(spent, 2.0, 1e-5, 5, conversion="classic") > oracle


def test_planner_refuses_an_exhausted_account():
    spent = RDPAccountant()
    spent.compose(LaplaceMechanism(1.0), 5)
    with pytest.raises(CalibrationInfeasible, match="already spent"):
        plan_noise_multiplier(spent, 1.0, 1e-5)


@pytest.mark.parametrize("target", [0, -1.0, float("nan"), "1"])
def test_planner_validates_target(target):
    with pytest.raises(ValueError, match="target_epsilon"):
        plan_noise_multiplier(RDPAccountant(), target, 1e-5)
