"""Choosing noise: the smallest Gaussian noise multiplier that still fits a budget.

This is what ``noise_multiplier="auto"`` in the operator runs: given what an account
has already spent (an accountant) and a target epsilon at the ledger's delta, find the
least noise for ``count`` more Gaussian releases. The search keeps the feasible end of
its bracket, so the answer never overspends.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.accountant import RDPAccountant
from dp_budget_provider.accounting.analytic_gaussian import calibrate_analytic_gaussian
from dp_budget_provider.accounting.conversion import Conversion, check_conversion
from dp_budget_provider.accounting.mechanisms import GaussianMechanism, Mechanism

__all__ = ["CalibrationInfeasible", "calibrate_analytic_gaussian", "plan_noise_multiplier"]

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
    target_epsilon = check.positive("target_epsilon", target_epsilon)
    delta = check.open_unit("delta", delta)
    count = check.count("count", count)
    conversion = check_conversion(conversion)

    def fits(noise_multiplier: float) -> bool:
        trial = spent.copy()
        trial.compose(mechanism_for(noise_multiplier), count)
        return trial.get_epsilon(delta, conversion)[0] <= target_epsilon

    if not fits(_MAX_NOISE_MULTIPLIER):
        spent_epsilon = spent.get_epsilon(delta, conversion)[0]
        raise CalibrationInfeasible(
            f"no noise multiplier up to {_MAX_NOISE_MULTIPLIER:g} keeps {count} more release(s)"
            f" within eps={target_epsilon} at delta={delta}: already spent eps={spent_epsilon}"
        )
    lo, hi = 1e-3, 1.0  # invariant once set up: fits(hi) and not fits(lo)
    while not fits(hi):
        lo, hi = hi, hi * 2.0
    if fits(lo):
        return lo
    while hi - lo > _RELATIVE_TOLERANCE * hi:
        mid = math.sqrt(lo * hi)
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi
