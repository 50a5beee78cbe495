"""The charge covers the snapped answer: vectors off the lattice pay for snapping, counts do not."""

from __future__ import annotations

import math
from decimal import Decimal, getcontext
from fractions import Fraction

import numpy as np
import pytest

from dp_budget_provider.accounting import (
    GaussianMechanism,
    LaplaceMechanism,
    RDPAccountant,
    ZCDPMechanism,
    plan_noise_multiplier_for,
)
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.accounting.lattice import Lattice
from dp_budget_provider.accounting.release import NoisePlan, plan_noise


def _snapped(plan: NoisePlan, answer: np.ndarray) -> np.ndarray:
    """The lattice indices the release adds noise to (the code path, not a model of it)."""
    assert plan.lattice is not None
    return plan.lattice.index(plan.rule.apply(answer, plan.lattice.limit)).astype(object)


def _charged_units(plan: NoisePlan) -> Fraction:
    """The sensitivity the charge pays for, in lattice units (squared for the Gaussian)."""
    assert plan.lattice is not None
    spread = plan.lattice.in_units(plan.spread)
    if plan.family == "gaussian":
        return Fraction(plan.charged.rho) * 2 * spread**2  # type: ignore[attr-defined]
    return Fraction(plan.charged.epsilon0) * spread  # type: ignore[attr-defined]


def _realised(plan: NoisePlan, a: np.ndarray, b: np.ndarray) -> int:
    """The snapped distance of two answers in lattice units (squared L2, or L1)."""
    diff = _snapped(plan, a) - _snapped(plan, b)
    return int(sum(d * d for d in diff)) if plan.family == "gaussian" else int(sum(map(abs, diff)))


def _exact_norm_at_most(a: np.ndarray, b: np.ndarray, norm: str, bound: float) -> bool:
    diff = [Fraction(x) - Fraction(y) for x, y in zip(a, b, strict=True)]
    if norm == "l1":
        return sum(map(abs, diff)) <= Fraction(bound)
    return sum(d * d for d in diff) <= Fraction(bound) ** 2


def _plan(norm: str, sensitivity: float, cells: int, granularity: float | None) -> NoisePlan:
    rule = AnswerRule(cells=cells)
    if norm == "l2":
        return plan_noise(
            GaussianMechanism(4.0), l2_sensitivity=sensitivity, granularity=granularity, rule=rule
        )
    return plan_noise(
        LaplaceMechanism(0.5), l1_sensitivity=sensitivity, granularity=granularity, rule=rule
    )


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_cells_nudged_across_a_rounding_boundary_are_charged(norm) -> None:
    """16 cells each move a little across 1/2 at granularity 1: every cell moves one unit."""
    cells, sensitivity = 16, 0.5
    step = sensitivity / cells if norm == "l1" else sensitivity / math.sqrt(cells)
    a = np.full(cells, 0.5 - step / 2)
    b = a + step
    assert _exact_norm_at_most(a, b, norm, sensitivity)
    plan = _plan(norm, sensitivity, cells, granularity=1)
    realised = _realised(plan, a, b)
    assert realised == cells  # L1 16 units, L2 4 units (squared: 16): far above ceil(0.5) = 1
    assert _charged_units(plan) >= realised


@pytest.mark.parametrize("norm", ["l1", "l2"])
@pytest.mark.parametrize("granularity", [1.0, 2**-3, None])
def test_random_and_adversarial_neighbours_never_exceed_the_charge(norm, granularity) -> None:
    rng = np.random.default_rng(2026)
    for _ in range(60):
        cells = int(rng.integers(1, 40))
        sensitivity = float(rng.choice([0.3, 1.0, 2.5, 7.0]))
        plan = _plan(norm, sensitivity, cells, granularity)
        g = float(plan.lattice.granularity)  # type: ignore[union-attr]
        charged = _charged_units(plan)
        for adversarial in (False, True):
            direction = rng.random(cells) + 0.01
            direction /= direction.sum() if norm == "l1" else np.sqrt((direction**2).sum())
            move = direction * sensitivity * (1 - 1e-9)
            if adversarial:  # every cell starts just below a tie, so both ends round apart
                a = (rng.integers(-50, 50, cells) + 0.5) * g - (move % g) / 2 - 1e-12
            else:
                a = rng.normal(0, 10, cells)
            b = a + move
            if not _exact_norm_at_most(a, b, norm, sensitivity):
                continue
            assert _realised(plan, a, b) <= charged


def test_the_l1_bound_is_attained() -> None:
    plan = _plan("l1", 0.5, 16, granularity=1)
    assert _charged_units(plan) == pytest.approx(16, rel=1e-12)  # ceil(0.5) + 16 - 1


@pytest.mark.parametrize("seed", range(5))
def test_l2_units_squared_is_the_largest_integer_below_the_bound(seed) -> None:
    getcontext().prec = 120
    rng = np.random.default_rng(seed)
    for _ in range(200):
        lattice = Lattice(Fraction(2) ** int(rng.integers(-40, 4)))
        sensitivity = float(rng.uniform(1e-3, 1e6))
        cells = int(rng.integers(2, 10**7))
        units = lattice.l2_units_squared(sensitivity, cells)
        ratio = Fraction(sensitivity) / lattice.granularity
        bound = (Decimal(ratio.numerator) / Decimal(ratio.denominator) + Decimal(cells).sqrt()) ** 2
        assert Decimal(units) < bound <= Decimal(units + 1)


def test_integer_answers_on_an_integer_lattice_pay_no_snapping() -> None:
    rule = AnswerRule(cells=16, integer=True, bounds=(0, 100))
    plan = plan_noise(GaussianMechanism(4.0), l2_sensitivity=1.0, granularity=1, rule=rule)
    assert plan.charged == ZCDPMechanism(rho=1 / 32)  # as a scalar of sensitivity 1
    counts = np.arange(16)
    assert np.array_equal(_snapped(plan, counts), counts)  # snapping is the identity
    with pytest.raises(TypeError, match="integer=True.*float64"):
        plan.noisy_array(counts.astype(float))


def test_integer_answers_on_a_coarser_lattice_are_charged_as_floats() -> None:
    rule = AnswerRule(cells=16, integer=True)
    as_counts = plan_noise(GaussianMechanism(4.0), l2_sensitivity=1.0, granularity=2, rule=rule)
    as_floats = plan_noise(
        GaussianMechanism(4.0), l2_sensitivity=1.0, granularity=2, rule=AnswerRule(cells=16)
    )
    assert as_counts.charged == as_floats.charged  # integers are off the lattice 2Z


def test_integer_answers_need_integer_bounds() -> None:
    with pytest.raises(ValueError, match="integer=True needs integer bounds"):
        AnswerRule(integer=True, bounds=(0, 7.5))


def test_more_cells_than_declared_fail_before_noise() -> None:
    plan = plan_noise(GaussianMechanism(4.0), l2_sensitivity=1.0)
    plan.noisy_array(3.0)
    plan.noisy_array([3.0])
    with pytest.raises(ValueError, match=r"2 cells .*cells=1") as refused:
        plan.noisy_array([3.25, 1.5])
    assert "3.25" not in str(refused.value)


def test_the_derived_granularity_keeps_the_inflation_within_a_1024th() -> None:
    for cells in (2, 16, 10**4, 10**6):
        for norm in ("l1", "l2"):
            plan = _plan(norm, 1.0, cells, granularity=None)
            scalar = _plan(norm, 1.0, 1, granularity=plan.granularity)
            ratio = float(_charged_units(plan) / _charged_units(scalar))
            assert ratio <= (1 + 1 / 1024) ** (2 if norm == "l2" else 1)


def test_a_declared_granularity_whose_noise_overflows_the_samplers_is_refused() -> None:
    with pytest.raises(ValueError, match="granularity=.*coarser"):
        plan_noise(GaussianMechanism(4.0), l2_sensitivity=1.0, granularity=2**-60)


# ---------------------------------------------------------------------------------------
# noise_multiplier="auto": the charge is not monotone in z, the answer must still fit
# ---------------------------------------------------------------------------------------


def _lattice_charge(z: float) -> ZCDPMechanism:
    """A scalar: its derived granularity follows sigma / 1024, so it changes with z."""
    return plan_noise(GaussianMechanism(z), l2_sensitivity=0.3).charged  # type: ignore[return-value]


def test_the_lattice_charge_is_not_monotone_in_z() -> None:
    """Where the derived granularity halves, the rounded-up sensitivity jumps the charge up."""
    zs = np.linspace(1.0, 8.0, 2000)
    rhos = np.array([_lattice_charge(float(z)).rho for z in zs])
    assert np.any(np.diff(rhos) > 0)


def test_auto_never_returns_a_z_charged_above_any_target() -> None:
    rng = np.random.default_rng(11)
    delta = 1e-5
    for _ in range(12):
        budgets = []
        for _ in range(int(rng.integers(1, 4))):
            spent = RDPAccountant()
            spent.compose(GaussianMechanism(float(rng.uniform(2.0, 20.0))))
            target = spent.get_epsilon(delta)[0] + float(rng.uniform(0.05, 3.0))
            budgets.append((spent, target))
        z = plan_noise_multiplier_for(budgets, delta, mechanism_for=_lattice_charge)
        for spent, target in budgets:
            trial = spent.copy()
            trial.compose(_lattice_charge(z))
            assert trial.get_epsilon(delta)[0] <= target
