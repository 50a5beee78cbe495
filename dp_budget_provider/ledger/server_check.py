"""Limits that let PostgreSQL decide a reservation the way the client would.

A reservation decided by the client holds the account's row lock across a round trip to
a client that competes for the CPU; on a busy key that round trip is the critical
section. The server cannot convert a spend to epsilon itself (the analytic-Gaussian
bound needs ``erfc``), but for an account without a residual curve the epsilon the
ledger reports is ``min(R(rho), G(mu^2))``: ``R`` the RDP conversion of the curve
``rho * orders``, ``G`` the exact Gaussian bound (``improved`` conversion, Gaussian-only
accounts). Both only grow with their argument, so ``epsilon <= cap`` holds whenever

    rho <= rho_limit   or   0 < mu^2 <= mu2_limit

with ``R(rho_limit)`` and ``G(mu2_limit)`` at most ``cap * (1 - MARGIN)``. The server
(``dp_reserve``) accepts a release on those terms only and leaves everything else,
refusals and releases within ``MARGIN`` of the cap included, to the client's exact
check: it never accepts what the client would refuse.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from dp_budget_provider.accounting import Conversion, gaussian_epsilon
from dp_budget_provider.ledger.spend import Spend

# Room left below the cap for rounding in the conversions (they are accurate to ~1e-15).
MARGIN = 1e-9
# How close the limit gets to the largest admissible value (relative); far inside MARGIN.
TOLERANCE = 1e-12
_LARGEST = 1e300


def largest_within(
    epsilon_of: Callable[[float], float], target: float, estimate: float = 1.0
) -> float:
    """A value x, within ``TOLERANCE`` below the largest, with ``epsilon_of(x) <= target``.

    ``epsilon_of`` grows with x. The root of ``epsilon_of(x) - target`` is bracketed from
    ``estimate`` (by factors of 4) and narrowed by regula falsi with the Illinois step, a
    dozen conversions instead of the fifty of a bisection: a task opening the ledger pays
    for this once. Only points found within the target become the answer, and a value
    the conversion cannot handle counts as over it, so the limit errs low (towards the
    client's own check). 0.0 when nothing positive fits.
    """

    def excess(x: float) -> float:
        try:
            value = float(epsilon_of(x)) - target
        except (ValueError, ArithmeticError):
            return math.inf
        return value if math.isfinite(value) else math.inf

    x = max(estimate, 1e-300)
    e_x = excess(x)
    if e_x <= 0:
        low, e_low = x, e_x
        high, e_high = x * 4, excess(x * 4)
        while e_high <= 0:
            low, e_low = high, e_high
            if high > _LARGEST:
                return low
            high, e_high = high * 4, excess(high * 4)
    else:
        high, e_high = x, e_x
        low, e_low = x / 4, excess(x / 4)
        while e_low > 0:
            high, e_high = low, e_low
            if low < 1e-300:
                return 0.0
            low, e_low = low / 4, excess(low / 4)
    side = 0
    for _ in range(200):
        if high - low <= TOLERANCE * high:
            break
        if math.isinf(e_high):
            middle = (low + high) / 2
        else:
            middle = low - e_low * (high - low) / (e_high - e_low)
            if not low < middle < high:
                middle = (low + high) / 2
        e_middle = excess(middle)
        if e_middle <= 0:
            low, e_low = middle, e_middle
            if side == -1:
                e_high /= 2  # Illinois: the stale end counts half
            side = -1
        else:
            high, e_high = middle, e_middle
            if side == 1:
                e_low /= 2
            side = 1
    return low


def _rho_estimate(cap_epsilon: float, delta: float) -> float:
    """rho where the classic conversion rho + 2 sqrt(rho log(1/delta)) reaches the cap."""
    log_inverse = math.log(1 / delta)
    return (math.sqrt(log_inverse + cap_epsilon) - math.sqrt(log_inverse)) ** 2


class CapLimits:
    """(rho_limit, mu2_limit or None) per cap, for one ledger's grid, delta and conversion."""

    def __init__(self, orders: np.ndarray, delta: float, conversion: Conversion) -> None:
        self._orders = orders
        self._delta = delta
        self._conversion = conversion
        self._known: dict[float, tuple[float, float | None]] = {}

    def _rdp_epsilon(self, rho: float) -> float:
        return Spend(rho, None, None).epsilon(self._orders, self._delta, self._conversion).epsilon

    def _gaussian_epsilon(self, mu2: float) -> float:
        return gaussian_epsilon(mu2**0.5, self._delta)

    def of(self, cap_epsilon: float) -> tuple[float, float | None]:
        """The limits for ``cap_epsilon`` (computed once per cap, a few ms)."""
        limits = self._known.get(cap_epsilon)
        if limits is None:
            target = cap_epsilon * (1 - MARGIN)
            estimate = _rho_estimate(cap_epsilon, self._delta)
            rho_limit = largest_within(self._rdp_epsilon, target, estimate)
            mu2_limit = (
                largest_within(self._gaussian_epsilon, target, 2 * estimate)
                if self._conversion == "improved"
                else None
            )
            limits = self._known[cap_epsilon] = (rho_limit, mu2_limit)
        return limits
