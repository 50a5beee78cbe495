"""Choosing noise: the smallest Gaussian noise multiplier that still fits a budget.

This is what ``noise_multiplier="auto"`` in the operator runs: given what an account
has already spent (an accountant) and a target epsilon at the ledger's delta, find the
least noise for ``count`` more Gaussian releases. The search keeps the feasible end of
its bracket and returns only a noise multiplier it checked, so the answer never
overspends, even when the charge is not monotone in z (lattice noise: the derived
granularity halves as z grows, and the sensitivity rounded up to lattice units jumps).
Then the answer may not be the least feasible z, only a feasible one. Several accounts
are checked together (``plan_noise_multiplier_for``): with a non-monotone charge the
largest of their separate answers need not fit them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.accountant import RDPAccountant
from dp_budget_provider.accounting.analytic_gaussian import calibrate_analytic_gaussian
from dp_budget_provider.accounting.conversion import Conversion, check_conversion
from dp_budget_provider.accounting.mechanisms import GaussianMechanism, Mechanism

__all__ = [
    "CalibrationInfeasible",
    "calibrate_analytic_gaussian",
    "plan_noise_multiplier",
    "plan_noise_multiplier_for",
    "plan_noise_multiplier_where",
]

_MAX_NOISE_MULTIPLIER = 1e8
_RELATIVE_TOLERANCE = 1e-10


class CalibrationInfeasible(ValueError):
    """No amount of noise fits: the account's past spend alone reaches the target."""


def plan_noise_multiplier(
    spent: RDPAccountant,
    target_epsilon: float,
    delta: float,
    count: int = 1,
    conversion: Conversion = "improved",
    mechanism_for: Callable[[float], Mechanism] = GaussianMechanism,
) -> float:
    """Smallest z such that ``count`` Gaussian(z) releases on top of ``spent`` stay <= target.

    ``mechanism_for`` maps z to the mechanism actually charged (discrete Gaussian noise
    is charged as zCDP, not as a continuous Gaussian). ``spent`` is not modified.
    Raises :class:`CalibrationInfeasible` when even z = 1e8 does not fit.
    """
    return plan_noise_multiplier_for(
        [(spent, target_epsilon)], delta, count, conversion, mechanism_for
    )


def plan_noise_multiplier_for(
    budgets: Sequence[tuple[RDPAccountant, float]],
    delta: float,
    count: int = 1,
    conversion: Conversion = "improved",
    mechanism_for: Callable[[float], Mechanism] = GaussianMechanism,
) -> float:
    """A least z with which ``count`` releases fit every ``(spent, target_epsilon)`` budget.

    The returned z was checked against every budget (see the module docstring: the
    charge need not be monotone in z, so no z is assumed to fit unchecked).
    """
    if not budgets:
        raise ValueError("budgets must name at least one (accountant, target_epsilon)")
    targets = [check.positive("target_epsilon", target) for _, target in budgets]
    delta = check.open_unit("delta", delta)
    count = check.count("count", count)
    conversion = check_conversion(conversion)

    def fits(noise_multiplier: float) -> bool:
        mechanism = mechanism_for(noise_multiplier)
        for (spent, _), target in zip(budgets, targets, strict=True):
            trial = spent.copy()
            trial.compose(mechanism, count)
            if trial.get_epsilon(delta, conversion)[0] > target:
                return False
        return True

    if not fits(_MAX_NOISE_MULTIPLIER):
        spent_epsilon = max(spent.get_epsilon(delta, conversion)[0] for spent, _ in budgets)
        raise CalibrationInfeasible(
            f"no noise multiplier up to {_MAX_NOISE_MULTIPLIER:g} keeps {count} more release(s)"
            f" within eps={min(targets)} at delta={delta}: already spent eps={spent_epsilon}"
        )
    return _least_fitting(fits, _MAX_NOISE_MULTIPLIER)


def plan_noise_multiplier_where(fits: Callable[[float], bool], what: str) -> float:
    """A least z with ``fits(z)``, for a caller whose test is not an accountant's epsilon
    against a target (the ledger's cap check, which may count a curve at one Rényi order:
    a privacy filter). Only a z checked to fit is returned, as above; ``what`` names the
    release in :class:`CalibrationInfeasible` when even z = 1e8 does not fit."""
    if not fits(_MAX_NOISE_MULTIPLIER):
        raise CalibrationInfeasible(
            f"no noise multiplier up to {_MAX_NOISE_MULTIPLIER:g} fits {what}"
        )
    return _least_fitting(fits, _MAX_NOISE_MULTIPLIER)


def _least_fitting(fits: Callable[[float], bool], ceiling: float) -> float:
    """Bisect for a small z with ``fits(z)``, given ``fits(ceiling)``; only a z known to fit
    is returned (with a non-monotone ``fits`` the doubling must stop at the ceiling)."""
    lo, hi = 1e-3, 1.0  # invariant once set up: fits(hi) and not fits(lo)
    while hi < ceiling and not fits(hi):
        lo, hi = hi, min(hi * 2.0, ceiling)
    if fits(lo):
        return lo
    while hi - lo > _RELATIVE_TOLERANCE * hi:
        mid = math.sqrt(lo * hi)
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi
