"""The verified reference numbers of DESIGN.md, reproduced on our accountant."""

import math

import pytest

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    GaussianMechanism,
    LaplaceMechanism,
    RDPAccountant,
    continuous_optimal_epsilon,
    zcdp_to_dp,
)


def composed(mechanism, count):
    accountant = RDPAccountant()
    accountant.compose(mechanism, count)
    return accountant


# (noise multiplier, count, delta, classic on grid, improved RDP on grid)
GAUSSIAN_TABLE = [
    (4.0, 20, 1e-5, 5.989924526737262, 5.377728336819822),
    (4.0, 20, 1e-6, 6.50197033148176, 5.926821861079906),
    (4.0, 1, 1e-5, 1.230943445524749, 1.0125506277526433),
    (1.0, 1, 1e-5, 5.298526138535465, 4.728507067217623),
    (2.0, 10, 1e-5, 8.837641821656742, 8.079406222420491),
]


@pytest.mark.parametrize(("z", "k", "delta", "classic", "improved"), GAUSSIAN_TABLE)
def test_gaussian_table_classic_and_improved_rdp(z, k, delta, classic, improved):
    accountant = composed(GaussianMechanism(z), k)
    assert accountant.get_epsilon(delta, "classic")[0] == pytest.approx(classic, rel=1e-12)
    bound = accountant.epsilon_bound(delta, "improved")
    # The improved RDP number is what dp_accounting reports; our default may go lower
    # through the exact Gaussian bound, never higher.
    from dp_budget_provider.accounting.conversion import rdp_to_epsilon

    rdp_only, _ = rdp_to_epsilon(DEFAULT_ORDERS, accountant.rdp, delta, "improved")
    assert rdp_only == pytest.approx(improved, rel=1e-12)
    assert bound.epsilon <= improved


def test_gaussian_z4_k20_classic_best_order_is_5_3():
    _, order = composed(GaussianMechanism(4.0), 20).get_epsilon(1e-5, "classic")
    assert order == pytest.approx(5.3)


def test_gaussian_z4_k20_improved_best_rdp_order_is_5():
    from dp_budget_provider.accounting.conversion import rdp_to_epsilon

    _, order = rdp_to_epsilon(DEFAULT_ORDERS, composed(GaussianMechanism(4.0), 20).rdp, 1e-5)
    assert order == 5.0


def test_gaussian_z4_k20_default_report_is_the_exact_gaussian_eps():
    bound = composed(GaussianMechanism(4.0), 20).epsilon_bound(1e-5)
    assert bound.method == "analytic-gaussian"
    assert bound.epsilon == pytest.approx(4.983306, abs=5e-7)


def test_gaussian_z4_k20_classic_continuous_optimum():
    eps, _ = continuous_optimal_epsilon(lambda a: 20 * a / 32, 1e-5, "classic")
    assert eps == pytest.approx(5.989915, abs=1e-6)
    assert eps == pytest.approx(zcdp_to_dp(20 / 32, 1e-5), rel=1e-10)


def test_laplace_eps0_0_1_k1000_improved():
    eps, _ = composed(LaplaceMechanism(0.1), 1000).get_epsilon(1e-5)
    assert eps == pytest.approx(18.5757, abs=1e-4)


# Seed 000: delta = 1e-6, sensitivity 1, eps = a + 2 sqrt(a log(1/delta)), a = k / (2 sigma^2).
SEED_000_TABLE = [
    (1, 4.0, 1.345380442439233),
    (10, 8.0, 2.1559476703363876),
    (100, 16.0, 3.4806386060980823),
    (1000, 8.0, 28.590726703363874),
]


@pytest.mark.parametrize(("k", "sigma", "closed"), SEED_000_TABLE)
def test_seed_000_closed_form_matches_dense_continuous_search(k, sigma, closed):
    rho = k / (2 * sigma**2)
    assert zcdp_to_dp(rho, 1e-6) == pytest.approx(closed, rel=1e-14)
    dense, alpha = continuous_optimal_epsilon(lambda a: rho * a, 1e-6, "classic")
    assert dense == pytest.approx(closed, rel=1e-10)
    assert alpha == pytest.approx(1 + math.sqrt(math.log(1e6) / rho), rel=1e-4)
    # The discrete grid can only do worse than the continuous optimum of its formula.
    grid = composed(GaussianMechanism(sigma), k).get_epsilon(1e-6, "classic")[0]
    assert grid >= dense - 1e-12
    assert grid - dense < 0.10 * dense
