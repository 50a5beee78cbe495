"""The exact privacy curve of the Gaussian mechanism (Balle & Wang 2018).

A composition of Gaussian releases with noise multipliers z_i is exactly a single
Gaussian with mu = sqrt(sum 1 / z_i^2) (Dong-Roth-Su's Gaussian DP), whose
(eps, delta) curve is

    delta(eps) = Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2).

No sound accountant may report less than the eps solving delta(eps) = delta; the
RDP conversions report more. Both searches below return the endpoint of their final
bracket on the safe side, so rounding can only over-state the loss, never under-state it.
"""

from __future__ import annotations

import math

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.special import log_ndtr

_BISECTION_STEPS = 200


def gaussian_delta(epsilon: float, mu: float) -> float:
    """Smallest delta for which a mu-GDP mechanism is (eps, delta)-DP."""
    epsilon = check.non_negative("epsilon", epsilon)
    mu = check.positive("mu", mu)
    first = math.exp(log_ndtr(-epsilon / mu + mu / 2.0))
    second = math.exp(epsilon + log_ndtr(-epsilon / mu - mu / 2.0))
    return max(0.0, first - second)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest eps with ``gaussian_delta(eps, mu) <= delta`` (exact, not an RDP bound)."""
    mu = check.positive("mu", mu)
    delta = check.open_unit("delta", delta)
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gaussian_delta(hi, mu) > delta:
        lo, hi = hi, hi * 2.0
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        if gaussian_delta(mid, mu) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def calibrate_analytic_gaussian(epsilon: float, delta: float, l2_sensitivity: float = 1.0) -> float:
    """Smallest sigma making one Gaussian release (eps, delta)-DP (Balle & Wang 2018, Alg. 1).

    Solved as the largest mu = sensitivity / sigma with delta(eps; mu) <= delta, by
    bisection keeping the feasible end, so the returned sigma is never too small.
    """
    epsilon = check.positive("epsilon", epsilon)
    delta = check.open_unit("delta", delta)
    l2_sensitivity = check.positive("l2_sensitivity", l2_sensitivity)
    lo, hi = 0.0, 1.0  # lo is always feasible (mu -> 0 gives delta -> 0), hi is not
    while gaussian_delta(epsilon, hi) <= delta:
        lo, hi = hi, hi * 2.0
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        if gaussian_delta(epsilon, mid) <= delta:
            lo = mid
        else:
            hi = mid
    if lo == 0.0:
        raise ValueError(f"no Gaussian noise level reaches eps={epsilon}, delta={delta}")
    return l2_sensitivity / lo
