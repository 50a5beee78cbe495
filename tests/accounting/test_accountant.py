"""RDPAccountant behaviour beyond the numbers: state, validation, atomicity."""

import math

import numpy as np
import pytest

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    AccountantState,
    GaussianMechanism,
    LaplaceMechanism,
    RDPAccountant,
    basic_composition,
    epsilon_bound,
)
from tests.accounting import mp_oracles


def test_rdp_property_is_a_copy():
    accountant = RDPAccountant()
    accountant.compose(GaussianMechanism(1.0))
    curve = accountant.rdp
    curve[:] = 0
    assert np.all(accountant.rdp > 0)


def test_default_orders_are_read_only():
    with pytest.raises(ValueError):
        DEFAULT_ORDERS[0] = 2.0


@pytest.mark.parametrize("delta", [0, 1, -1e-5, 1.5, float("nan"), True, "1e-5"])
def test_delta_outside_open_unit_interval_raises(delta):
    accountant = RDPAccountant()
    with pytest.raises(ValueError, match="delta"):
        accountant.get_epsilon(delta)


@pytest.mark.parametrize("count", [0, -3, 1.5, 2.0, True, "2", None])
def test_count_must_be_a_positive_int(count):
    accountant = RDPAccountant()
    with pytest.raises(ValueError, match="count"):
        accountant.compose(GaussianMechanism(1.0), count)
    assert not np.any(accountant.rdp)


def test_conversion_name_is_checked():
    with pytest.raises(ValueError, match="conversion"):
        RDPAccountant().get_epsilon(1e-5, "optimistic")


@pytest.mark.parametrize("orders", [[1.0, 2.0], [0.5], [], [2.0, 2.0], [2.0, float("inf")], "abc"])
def test_bad_order_grids_are_refused(orders):
    with pytest.raises(ValueError, match="orders"):
        RDPAccountant(orders)


def test_a_bad_item_in_a_batch_leaves_the_accountant_untouched():
    accountant = RDPAccountant()
    accountant.compose(GaussianMechanism(2.0))
    before = accountant.state()
    with pytest.raises(ValueError):
        accountant.compose_many([(GaussianMechanism(1.0), 3), (LaplaceMechanism(1.0), 0)])
    with pytest.raises(ValueError):
        accountant.compose_many([GaussianMechanism(1.0), "not a mechanism"])
    assert accountant.state() == before


def test_gaussian_mu_tracks_only_pure_gaussian_sequences():
    accountant = RDPAccountant()
    assert accountant.gaussian_mu_squared == 0.0
    accountant.compose(GaussianMechanism(2.0), 3)
    accountant.compose(GaussianMechanism(4.0))
    assert accountant.gaussian_mu_squared == pytest.approx(3 / 4 + 1 / 16)
    assert accountant.epsilon_bound(1e-5).method == "analytic-gaussian"
    accountant.compose(LaplaceMechanism(0.1))
    assert accountant.gaussian_mu_squared is None
    assert accountant.epsilon_bound(1e-5).method == "rdp-improved"
    assert accountant.epsilon_bound(1e-5, "classic").method == "rdp-classic"


def test_state_round_trip_and_copy_independence():
    accountant = RDPAccountant()
    accountant.compose(GaussianMechanism(1.5), 7)
    restored = RDPAccountant.from_state(accountant.state())
    assert restored.get_epsilon(1e-6) == accountant.get_epsilon(1e-6)
    copy = accountant.copy()
    copy.compose(GaussianMechanism(1.0))
    assert copy.get_epsilon(1e-6)[0] > accountant.get_epsilon(1e-6)[0]


ZEROS = (0.0,) * DEFAULT_ORDERS.size
GRID = tuple(DEFAULT_ORDERS)


@pytest.mark.parametrize(
    "state",
    [
        AccountantState(GRID, 0.0, (float("nan"),) * DEFAULT_ORDERS.size, None),
        AccountantState(GRID, 0.0, (-1.0,) * DEFAULT_ORDERS.size, None),
        AccountantState(GRID, 0.0, (0.0,) * 3, None),
        AccountantState(GRID, float("nan"), ZEROS, None),
        AccountantState(GRID, -0.5, ZEROS, None),
        AccountantState(GRID, 0.1, ZEROS, float("nan")),
        AccountantState((1.0, 2.0), 0.0, (0.0, 0.0), None),
    ],
)
def test_corrupt_state_is_refused(state):
    with pytest.raises(ValueError):
        RDPAccountant.from_state(state)


def test_epsilon_grows_with_every_release():
    accountant = RDPAccountant()
    last = 0.0
    for mechanism in [GaussianMechanism(5.0), LaplaceMechanism(0.2), GaussianMechanism(3.0)] * 5:
        accountant.compose(mechanism)
        eps = accountant.get_epsilon(1e-5)[0]
        assert eps > last
        last = eps


def test_a_cap_at_the_exact_gaussian_bound_is_never_passed():
    # A ledger whose cap is gaussian_epsilon(1e-4, 1e-10) compares this eps with it: the
    # eps must be at or above the exact one, or a release over the cap is granted.
    accountant = RDPAccountant()
    accountant.compose(GaussianMechanism(1e4))
    bound = accountant.epsilon_bound(1e-10)
    assert bound.method == "analytic-gaussian"
    assert mp_oracles.gaussian_delta(bound.epsilon, 1e-4) <= 1e-10


def test_a_gaussian_mu_squared_that_does_not_describe_the_curve_is_refused():
    curve = DEFAULT_ORDERS * 0.5  # a Gaussian composition with mu^2 = 1
    assert epsilon_bound(DEFAULT_ORDERS, curve, 1.0, 1e-5).method == "analytic-gaussian"
    for wrong in (1e-6, 5.0):
        with pytest.raises(ValueError, match="gaussian_mu_squared"):
            epsilon_bound(DEFAULT_ORDERS, curve, wrong, 1e-5)


@pytest.mark.parametrize(("z", "granted"), [(1e-200, False), (1e-160, False), (1e300, True)])
def test_extreme_noise_multipliers_give_an_answer(z, granted):
    accountant = RDPAccountant()
    accountant.compose(GaussianMechanism(z), 2**53)
    epsilon = accountant.get_epsilon(1e-5)[0]
    assert (epsilon == 0.0) if granted else (epsilon == math.inf)


@pytest.mark.parametrize("count", [10**400, 2**53 + 1])
def test_counts_beyond_exact_doubles_are_refused(count):
    with pytest.raises(ValueError, match="count"):
        RDPAccountant().compose(GaussianMechanism(1.0), count)
    with pytest.raises(ValueError, match="count"):
        basic_composition(1.0, count)
