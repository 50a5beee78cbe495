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

from collections.abc import Callable

import numpy as np

from dp_budget_provider.accounting import Conversion, gaussian_epsilon
from dp_budget_provider.ledger.spend import Spend

# Room left below the cap for rounding in the conversions (they are accurate to ~1e-15).
MARGIN = 1e-9
_SMALLEST = 1e-12
_LARGEST = 1e300


def largest_within(epsilon_of: Callable[[float], float], target: float) -> float:
    """The largest x found with ``epsilon_of(x) <= target`` (0.0 if none above 1e-12).

    Doubling then bisection down to adjacent doubles. An argument the conversion cannot
    handle counts as over the target, so the limit errs low (towards the client's check).
    """

    def within(x: float) -> bool:
        try:
            return bool(epsilon_of(x) <= target)
        except (ValueError, ArithmeticError):
            return False

    low, high = 0.0, _SMALLEST
    while within(high):
        low, high = high, high * 2
        if high > _LARGEST:
            return low
    while True:
        middle = (low + high) / 2
        if not low < middle < high:
            return low
        if within(middle):
            low = middle
        else:
            high = middle


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
            rho_limit = largest_within(self._rdp_epsilon, target)
            mu2_limit = (
                largest_within(self._gaussian_epsilon, target)
                if self._conversion == "improved"
                else None
            )
            limits = self._known[cap_epsilon] = (rho_limit, mu2_limit)
        return limits
