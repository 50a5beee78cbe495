"""The exact privacy curve of the Gaussian mechanism (Balle & Wang 2018).

A composition of Gaussian releases with noise multipliers z_i is exactly a single
Gaussian with mu = sqrt(sum 1 / z_i^2) (Dong-Roth-Su's Gaussian DP), whose
(eps, delta) curve is

    delta(eps) = Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2).

No sound accountant may report less than the eps solving delta(eps) = delta; the
RDP conversions report more. Both searches below return the endpoint of their final
bracket on the safe side, and decide with a ``delta`` raised by a bound of its own
rounding error (:func:`gaussian_delta`), so rounding can only over-state the loss,
never under-state it: the eps returned is at least the exact eps of the exact mu.

How the searches are made fast without changing their answers
-------------------------------------------------------------
The reference algorithm for both searches is plain bisection: double an upper end
until it crosses, then halve the bracket until its ends are adjacent floats, deciding
every probe with the computed ``delta`` (kept verbatim as :func:`_reference_epsilon`
and :func:`_reference_mu`, the fallback). Evaluating ``delta`` at all ~60 probes was
the ledger's largest client-side CPU cost, so the searches now run in two stages:

1. A safeguarded Newton iteration on ``sqrt(-2 log delta)`` (:func:`_newton`) finds
   the root approximately, using the closed-form derivatives
   ``d delta / d eps = -e^eps Phi(-eps/mu - mu/2)`` and
   ``d delta / d mu = phi(-eps/mu + mu/2)`` (both follow from
   ``phi(-eps/mu + mu/2) = e^eps phi(-eps/mu - mu/2)``). Its evaluations are
   approximate (a scalar series stands in for ``log_ndtr``'s slow numpy tail) and
   never decide anything. A rounding-error model of ``delta`` (:func:`_curve`) gives
   the half-width of the band around the root in which the computed ``delta`` may be
   non-monotone: thousands of ulps of eps when mu is small and the two terms cancel,
   a few ulps when mu is large. Measured bands stay within that model; the guard
   interval put around the estimate is ``_GUARD_FACTOR`` times wider.
2. The reference doubling and bisection are replayed probe by probe
   (:func:`_replay_bisection`). Probes outside the guard interval are decided by the
   side of it they fall on; only the probes inside it (~log2 of its width in ulps,
   10-20 in practice) evaluate ``delta``. When the computed curve is monotone outside
   the guard interval, which the error model is built to ensure, the replay takes
   exactly the reference's decisions, so the result is bit-identical to it.

Soundness never rests on the error model or on Newton: every end of the final bracket
is evaluated with the same ``delta`` as ``gaussian_delta`` (during the replay or
afterwards; the one exception is the calibration's lower end mu = 0, which the
reference never evaluates either and which makes it raise), and unless the safe end
passes the check ``delta <= target`` and the other end fails it, the search falls
back to the reference bisection. So the answer is always feasible and the other end
of its bracket (the adjacent float, unless the reference's 200-step cap was hit)
infeasible. Outside the range where the fast path was
validated (mu > 1e4 or eps > 1e9, where ``delta`` itself stops being accurate), and
whenever Newton does not settle, the reference runs as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.special import log_ndtr

_BISECTION_STEPS = 200

_SQRT_2 = math.sqrt(2.0)
_LOG_2 = math.log(2.0)
_HALF_LOG_PI = 0.5 * math.log(math.pi)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
# log_ndtr(x) leaves the pure-``math`` branches (and becomes ~20x slower, going through
# numpy) once -x / sqrt(2) reaches this; the Newton stage uses a scalar series there.
_LOG_NDTR_ASYMPTOTIC_FROM = 8.0
_SERIES_MAX_TERMS = 20
_UNIT_ROUNDOFF = 2.0**-53
_LOG_MAX_DOUBLE = math.log(2.0**1023)
# Guard half-width = _GUARD_FACTOR x the modelled non-monotone band (+ a few ulps).
_GUARD_FACTOR = 8.0
_GUARD_ULPS = 4.0
_NEWTON_STEPS = 60
# The certified delta is the computed one plus this many times the modelled rounding
# error, plus the most an underflowing term can lose.
_CERTIFIED_FACTOR = 4.0
_UNDERFLOW = 2.0**-1020
# The fast path is used only where it was validated against the reference. Beyond it
# (eps ~ mu^2 / 2 in the tens of millions and up) delta loses its accuracy to the
# cancellation in eps + log Phi(b) (the certified delta grows with the lost digits, so
# the search errs high); there the reference bisection runs.
_FAST_PATH_MAX_MU = 1e4
_FAST_PATH_MAX_EPSILON = 1e9


def _delta(epsilon: float, mu: float) -> float:
    """``gaussian_delta`` without argument checks (bit-identical to it)."""
    return _upper_delta(*_curve(epsilon, mu, log_ndtr))


def _upper_delta(first: float, second: float, error: float) -> float:
    """The computed ``first - second`` raised by a bound of its rounding error.

    ``_CERTIFIED_FACTOR`` times the modelled error (measured against mpmath at 50 digits:
    the actual error never exceeded the model) plus the largest value an underflow of
    either term can lose. Where the model itself overflows (0 * inf is NaN at mu ~ 1e160)
    nothing is certain but delta <= 1, which is what is returned.
    """
    bound = max(0.0, first - second) + _CERTIFIED_FACTOR * error + _UNDERFLOW
    return bound if bound < 1.0 else 1.0


def gaussian_delta(epsilon: float, mu: float) -> float:
    """An upper bound of the smallest delta for which a mu-GDP mechanism is (eps, delta)-DP.

    The two terms of the curve cancel where mu is small (delta is far below either), so the
    computed difference is raised by a bound of its rounding error: the exact delta is
    never above the value returned, and every search built on it errs on the safe side.
    """
    epsilon = check.non_negative("epsilon", epsilon)
    mu = check.positive("mu", mu)
    return _delta(epsilon, mu)


def _approx_log_ndtr(x: float) -> float:
    """log Phi(x) to ~1e-16 relative: exactly ``log_ndtr`` on its ``math`` branches and a
    scalar version of its asymptotic series in the far left tail (Newton stage only)."""
    if x >= 0.0:
        return log_ndtr(x)
    t = -x / _SQRT_2
    if t < _LOG_NDTR_ASYMPTOTIC_FROM:
        return log_ndtr(x)
    t2 = t * t
    if t2 == math.inf:
        return -math.inf
    s = 0.5 / t2
    n_terms, bound = 0, s
    while n_terms < _SERIES_MAX_TERMS and bound > 1e-18:
        n_terms += 1
        bound *= (2 * n_terms + 1) * s
    series = 1.0
    for k in range(n_terms, 0, -1):
        series = 1.0 - (2 * k - 1) * s * series
    return -t2 - math.log(t) - _HALF_LOG_PI + math.log(series) - _LOG_2


def _curve(
    epsilon: float, mu: float, log_phi: Callable[[float], float] = _approx_log_ndtr
) -> tuple[float, float, float]:
    """(first, second, modelled absolute rounding error of their difference).

    ``first = Phi(a)`` and ``second = e^eps Phi(b)`` with ``a, b = -eps/mu +- mu/2``,
    with ``log_phi`` for log Phi (``log_ndtr`` for the decisions, the faster
    ``_approx_log_ndtr`` for Newton). The error model bounds, to first order and with
    small constants, what the computation can lose: the rounding of ``a`` and ``b``
    (absolute ``u (eps/mu + mu/2)``, amplified by ``d log Phi / dx``, at most
    ``|x| + 1``), a few ulps inside ``log_ndtr`` and ``exp``, and the rounding of
    ``eps + log Phi(b)``.
    """
    ratio = epsilon / mu
    half = mu / 2.0
    a = -ratio + half
    b = -ratio - half
    log_first = log_phi(a)
    log_phi_b = log_phi(b)
    exponent = epsilon + log_phi_b
    first = math.exp(log_first)
    # e^eps Phi(b) overflows only where eps + log Phi(b) has lost every digit (eps ~ mu^2 / 2
    # beyond 1e300): the error model is then infinite and the certified delta 1.
    second = math.exp(exponent) if exponent < _LOG_MAX_DOUBLE else math.inf
    argument_error = ratio + half
    slope_a = -a + 1.0 if a < 0.0 else 1.0
    slope_b = -b + 1.0
    rel_first = argument_error * slope_a + abs(log_first) + 8.0
    rel_second = argument_error * slope_b + abs(log_phi_b) + abs(exponent) + epsilon + 8.0
    error = _UNIT_ROUNDOFF * (first * rel_first + second * rel_second)
    return first, second, error


def _replay_bisection(
    left_of_root: Callable[[float], bool],
    lo: float,
    hi: float,
    left_guard: float,
    right_guard: float,
) -> tuple[float, float]:
    """The reference doubling + bisection, evaluating ``left_of_root`` only in the guard.

    Probes at or below ``left_guard`` are taken to lie left of the root, probes at or
    above ``right_guard`` right of it. The arithmetic (``hi * 2``, ``(lo + hi) / 2``,
    the stopping rule and the step cap) is the reference's, so with faithful guards the
    returned bracket is the reference's bracket.
    """
    while True:
        if hi <= left_guard:
            left = True
        elif hi >= right_guard:
            left = False
        else:
            left = left_of_root(hi)
        if not left:
            break
        lo, hi = hi, hi * 2.0
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2.0
        if not lo < mid < hi:  # mid is in [lo, hi]: the reference's ``mid in (lo, hi)``
            break
        if mid <= left_guard:
            lo = mid
        elif mid >= right_guard:
            hi = mid
        elif left_of_root(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def _reference_epsilon(mu: float, delta: float) -> float:
    """The reference search: plain bisection on the validating ``gaussian_delta``."""
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


def _newton(
    curve: Callable[[float], tuple[float, float, float]],
    x: float,
    delta: float,
    decreasing: bool,
    x_max: float,
) -> tuple[float, float] | None:
    """Safeguarded Newton for delta(x) = ``delta``: (root estimate, guard) or None.

    ``curve(x)`` gives the approximate delta, its derivative in x and the modelled
    rounding error of the computed delta; ``decreasing`` says which way delta runs.
    Newton runs on h = sqrt(-2 log delta), which is nearly linear in eps and in mu
    (delta is roughly a normal tail Phi(-h)), so it converges in 3-5 evaluations.
    Steps leaving the bracket of visited points fall back to bisection (doubling
    while there is no upper end). Stops once a step is within the modelled band (or
    two ulps), or once quadratic convergence predicts the error left is. The guard
    covers the band ``_GUARD_FACTOR`` times over plus twice the estimate's residual.
    None if x leaves (0, x_max] or Newton does not settle: the caller then bisects.
    """
    target = math.sqrt(-2.0 * math.log(delta))
    lo, hi = 0.0, math.inf  # bracket of visited points: root in (lo, hi)
    previous = math.inf  # the last Newton step, when the last move was one
    for _ in range(_NEWTON_STEPS):
        if not 0.0 < x <= x_max:
            return None
        value, slope, error = curve(x)
        if (value > delta) == decreasing:
            lo = x
        else:
            hi = x
        if 0.0 < value < 1.0 and slope != 0.0:
            h = math.sqrt(-2.0 * math.log(value))
            step = (h - target) * h * value / slope  # dh/dx = -slope / (value h)
            band = error / abs(slope)
            tolerance = max(band, 2.0 * math.ulp(x))
            # Quadratic convergence: the error left after this step is ~ step^3 / previous^2.
            predicted = abs(step) * (step / previous) ** 2
            if abs(step) <= tolerance or (
                previous < math.inf and abs(step) <= 1e-3 * abs(previous) and predicted <= tolerance
            ):
                x += step
                residual = abs(step) if abs(step) <= tolerance else 4.0 * predicted
                guard = _GUARD_FACTOR * band + 2.0 * residual + _GUARD_ULPS * math.ulp(x)
                return (x, guard) if math.isfinite(guard) else None
            candidate = x + step
        else:
            candidate = math.nan
        if lo < candidate < hi:
            previous = step
        else:  # Newton left the bracket: bisect (or double)
            candidate = (lo + hi) / 2.0 if hi < math.inf else 2.0 * x
            previous = math.inf
        x = candidate
    return None


def _normal_quantile_guess(delta: float) -> float:
    """Rough z with Phi(-z) = delta, for Newton's starting point (Mills-ratio corrected)."""
    z2 = -2.0 * math.log(delta)
    correction = math.log(2.0 * math.pi * z2)  # from Phi(-z) ~ phi(z) / z, for large z
    return math.sqrt(z2 - correction if 0.0 < correction < 0.75 * z2 else z2)


def _estimate_epsilon(mu: float, delta: float) -> tuple[float, float] | None:
    """Approximate root of delta(eps) = ``delta`` and its guard half-width, or None."""

    def curve(epsilon: float) -> tuple[float, float, float]:
        first, second, error = _curve(epsilon, mu)
        return _upper_delta(first, second, error), -second, error  # d/d eps = -e^eps Phi(b)

    # Where Phi(-eps/mu + mu/2), the first term alone, equals delta.
    start = mu * (mu / 2.0 + _normal_quantile_guess(delta))
    return _newton(curve, start, delta, True, _FAST_PATH_MAX_EPSILON)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest eps with ``gaussian_delta(eps, mu) <= delta`` (exact, not an RDP bound).

    Returns the feasible end of the reference bisection's final bracket (adjacent
    floats), computed with a Newton estimate and a guarded replay of the bisection; see
    the module docstring.
    """
    mu = check.positive("mu", mu)
    delta = check.open_unit("delta", delta)
    if _delta(0.0, mu) <= delta:
        return 0.0
    estimate = _estimate_epsilon(mu, delta) if mu <= _FAST_PATH_MAX_MU else None
    if estimate is None:
        return _reference_epsilon(mu, delta)
    root, guard = estimate
    left_guard, right_guard = root - guard, root + guard

    def infeasible(epsilon: float) -> bool:
        return _delta(epsilon, mu) > delta

    lo, hi = _replay_bisection(infeasible, 0.0, 1.0, left_guard, right_guard)
    # Ends decided by a guard were not evaluated; check them (lo = 0 was, above).
    hi_ok = hi < right_guard or not infeasible(hi)
    lo_ok = lo == 0.0 or lo > left_guard or infeasible(lo)
    if hi_ok and lo_ok:
        return hi
    return _reference_epsilon(mu, delta)


def _reference_mu(epsilon: float, delta: float) -> float:
    """The reference calibration search (bisection on the validating ``gaussian_delta``)."""
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
    return lo


def _estimate_mu(epsilon: float, delta: float) -> tuple[float, float] | None:
    """Approximate root of delta(eps; mu) = ``delta`` in mu and its guard half-width."""
    if epsilon > _FAST_PATH_MAX_EPSILON:
        return None

    def curve(mu: float) -> tuple[float, float, float]:
        first, second, error = _curve(epsilon, mu)
        a = -epsilon / mu + mu / 2.0
        return _upper_delta(first, second, error), math.exp(-0.5 * a * a - _HALF_LOG_2PI), error

    # mu^2 / 2 + z mu = eps: where the first term alone, Phi(-eps/mu + mu/2), is delta.
    z = _normal_quantile_guess(delta)
    start = 2.0 * epsilon / (math.sqrt(z * z + 2.0 * epsilon) + z)
    return _newton(curve, start, delta, False, _FAST_PATH_MAX_MU)


def _calibrated_mu(epsilon: float, delta: float) -> float:
    """The reference's largest feasible mu (0.0 if its bracket never left 0)."""
    estimate = _estimate_mu(epsilon, delta)
    if estimate is None:
        return _reference_mu(epsilon, delta)
    root, guard = estimate
    left_guard, right_guard = root - guard, root + guard

    def feasible(mu: float) -> bool:
        return _delta(epsilon, mu) <= delta

    lo, hi = _replay_bisection(feasible, 0.0, 1.0, left_guard, right_guard)
    lo_ok = lo == 0.0 or lo > left_guard or feasible(lo)
    hi_ok = hi < right_guard or not feasible(hi)
    if lo_ok and hi_ok:
        return lo
    return _reference_mu(epsilon, delta)


def calibrate_analytic_gaussian(epsilon: float, delta: float, l2_sensitivity: float = 1.0) -> float:
    """Smallest sigma making one Gaussian release (eps, delta)-DP (Balle & Wang 2018, Alg. 1).

    Solved as the largest mu = sensitivity / sigma with delta(eps; mu) <= delta, by
    bisection keeping the feasible end, so the returned sigma is never too small (the
    bisection is replayed around a Newton estimate, as for :func:`gaussian_epsilon`).
    Feasibility is decided with the certified :func:`gaussian_delta` and the quotient is
    rounded up, so sigma is at least the exact calibration, rounding included.
    """
    epsilon = check.positive("epsilon", epsilon)
    delta = check.open_unit("delta", delta)
    l2_sensitivity = check.positive("l2_sensitivity", l2_sensitivity)
    lo = _calibrated_mu(epsilon, delta)
    if lo == 0.0:
        raise ValueError(f"no Gaussian noise level reaches eps={epsilon}, delta={delta}")
    return math.nextafter(l2_sensitivity / lo, math.inf)  # the quotient rounded up
