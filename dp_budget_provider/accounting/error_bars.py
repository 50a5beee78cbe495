"""Error bars of a release: each value's noise standard deviation and a confidence interval
that never under-covers, for the noise actually drawn.

Why a module of its own: a noisy number without its accuracy invites over-reading it, and
an interval computed from a textbook formula (``1.96 sigma`` of a continuous Gaussian)
describes noise the release never adds. The lattice noise is a discrete Gaussian or a
discrete Laplace in lattice units, at the parameter the sampler really uses
(``effective_discrete_gaussian_sigma2``, ``effective_discrete_laplace_scale``), so the
interval is computed for that distribution:

* the half-width is ``q * granularity`` for the least integer ``q`` with
  ``P(|Y| <= q) >= confidence`` under the exact pmf (outputs are lattice points, so no
  other half-width is worth reporting);
* **discrete Gaussian on a sampler table** (sigma up to about 2.8e4 units, where the
  derived lattice puts most releases): ``q`` is read from the certified CDF table
  the sampler inverts (``cdf_sampler.cdf_bounds``: integers ``lo <= 2**bits P(|Y| <= k) <=
  hi``). ``q`` is the first ``k`` whose *lower* bound reaches the level, so coverage is
  proven; it is the least such ``k`` when ``hi[q-1]`` is below the level, which is
  checked, with 64 more bits of precision while it is not (then ``q`` is exact);
* **discrete Gaussian past the tables**: a proven upper bound of the tail,
  ``P(|Y| > q) <= erfc(a / (s sqrt 2))`` with ``a = q + 1/2`` once ``q + 1/2 >= s`` (else
  ``a = q``). Proof: the weights ``w(y) = exp(-y^2 / 2s^2)`` decrease, so ``w(y) <=
  integral of w over [y-1, y]``; they are convex past ``s``, so ``w(y) <= integral over
  [y-1/2, y+1/2]`` (Hermite-Hadamard) there; and the normaliser ``Z = sum_y w(y) = sqrt(2
  pi) s sum_k exp(-2 pi^2 s^2 k^2) >= sqrt(2 pi) s`` (Poisson summation, every term
  positive). ``erfc`` is a libm value, accurate to a few ulps: a relative margin of 1e-12
  is added. ``q`` may then be above the least by one unit (under 1/28000 of sigma) plus
  what the margin costs (about 1e-12 sigma^2 / q units: a relative 1e-11 of sigma);
* **discrete Laplace**: exact in closed form, ``P(|Y| > q) = 2 p^(q+1) / (1 + p)`` with
  ``p = exp(-1/t)`` (``Z = (1 + p) / (1 - p)``, geometric tails), evaluated with the
  certified bounds of ``exp`` the sampler's tables use (``exp_neg_bounds``).

The intervals are centred on the released value and not clamped: the released value is
what carries the noise, and clamping a count's interval at 0 would make its coverage a
statement about the exact count rather than about the noise alone. A reader who knows a
count is non-negative may intersect. Unsafe float noise gets the continuous quantiles
(``NormalDist``, ``-b log(1 - c)``), in floating point like the noise itself.

``least_noise_within`` turns an accuracy target into a Gaussian noise multiplier:
the largest (the cheapest to charge) whose interval at the level is at most the error.

Layering: standard library, the samplers' exact parameters and tables, the noise plan.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from statistics import NormalDist

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.calibration import plan_noise_multiplier_where
from dp_budget_provider.accounting.cdf_sampler import (
    TABLE_BITS,
    Family,
    cdf_bounds,
    exp_neg_bounds,
    has_table,
)
from dp_budget_provider.accounting.noise import (
    effective_discrete_gaussian_sigma2,
    effective_discrete_laplace_scale,
)
from dp_budget_provider.accounting.release import NoisePlan

__all__ = [
    "ErrorBars",
    "check_confidence",
    "error_bars",
    "gaussian_half_width_units",
    "laplace_half_width_units",
    "least_noise_within",
]

#: Relative margin on libm's erfc (a few ulps accurate) in the Gaussian tail bound.
_ERFC_MARGIN = 1e-12
#: Refinements of a table whose bounds leave the least q undecided (each adds 64 bits).
_REFINEMENTS = 3
_EXP_BITS = 64


def check_confidence(name: str, value: object) -> float:
    """A confidence level strictly between 0 and 1 (ValueError otherwise)."""
    level = check.real(name, value)
    if not 0.0 < level < 1.0:
        raise ValueError(f"{name} must be strictly between 0 and 1, got {value!r}")
    return level


@dataclass(frozen=True)
class ErrorBars:
    """The accuracy of every value of one release, in the answer's units: the noise's
    standard deviation and the half-width of the interval at ``confidence``."""

    stddev: float
    half_width: float
    confidence: float

    def interval(self, value: float) -> list[float]:
        """``[value - half_width, value + half_width]``, not clamped."""
        return [float(value) - self.half_width, float(value) + self.half_width]


def error_bars(plan: NoisePlan, confidence: float) -> ErrorBars:
    """The error bars of a release noised as ``plan`` (every value gets the same noise)."""
    confidence = check_confidence("confidence", confidence)
    return ErrorBars(plan.noise_std, half_width(plan, confidence), confidence)


def half_width(plan: NoisePlan, confidence: float) -> float:
    """The least half-width (a lattice multiple for lattice noise) whose interval holds
    the noise with probability at least ``confidence``."""
    if plan.lattice is None:
        if plan.family == "gaussian":
            return plan.spread * NormalDist().inv_cdf((1.0 + confidence) / 2.0)
        return -plan.spread * math.log1p(-confidence)
    units = plan.lattice.in_units(plan.spread)
    if plan.family == "gaussian":
        q = gaussian_half_width_units(effective_discrete_gaussian_sigma2(units), confidence)
    else:
        q = laplace_half_width_units(effective_discrete_laplace_scale(units), confidence)
    return float(q * plan.lattice.granularity)  # exact: a power of two times q < 2**53


def gaussian_half_width_units(sigma2: Fraction, confidence: float) -> int:
    """The least integer ``q`` (see the module docstring for when it may be one more) with
    ``P(|Y| <= q) >= confidence`` for the discrete Gaussian of variance parameter
    ``sigma2``, P[y] proportional to exp(-y^2 / (2 sigma2)); coverage is proven."""
    family = Family("gaussian", Fraction(sigma2))
    if has_table(family):
        return _from_table(family, Fraction(confidence))
    s = math.sqrt(float(sigma2)) * (1.0 - 2.0**-50)  # a smaller s only widens the bound
    allowed = 1.0 - confidence

    def covered(q: int) -> bool:
        a = q + 0.5 if q + 0.5 >= s else float(q)
        return math.erfc(a / (s * math.sqrt(2.0))) * (1.0 + _ERFC_MARGIN) <= allowed

    guess = math.ceil(s * NormalDist().inv_cdf((1.0 + confidence) / 2.0))
    return _least(covered, guess)


def laplace_half_width_units(scale: Fraction, confidence: float) -> int:
    """The least integer ``q`` with ``P(|Y| <= q) >= confidence`` for the discrete Laplace
    of scale ``scale`` (P[y] proportional to exp(-|y| / scale)), from the closed form
    with certified bounds of exp (coverage proven; least unless a bound is within 2**-60
    of the level)."""
    t = Fraction(scale)
    allowed = 1 - Fraction(confidence)
    one = 1 << _EXP_BITS
    p_low, _ = exp_neg_bounds(1 / t, _EXP_BITS)

    def covered(q: int) -> bool:
        _, tail_high = exp_neg_bounds((q + 1) / t, _EXP_BITS)  # p^(q+1), from above
        return Fraction(2 * tail_high, one + p_low) <= allowed

    p = math.exp(-1.0 / float(t))
    guess = math.ceil(float(t) * math.log(2.0 / ((1.0 - confidence) * (1.0 + p)))) - 1
    return _least(covered, max(guess, 0))


def _least(covered: Callable[[int], bool], guess: int) -> int:
    """The least ``q >= 0`` with ``covered(q)`` (monotone in ``q``), searched from a guess."""
    q = max(guess, 0)
    while not covered(q):
        q += 1
    while q > 0 and covered(q - 1):
        q -= 1
    return q


def _from_table(family: Family, level: Fraction) -> int:
    """The first ``k`` whose certified lower bound of ``P(|Y| <= k)`` reaches ``level``;
    refined while the upper bound at ``k - 1`` does not prove it the least."""
    bits = TABLE_BITS
    for _ in range(_REFINEMENTS + 1):
        low, high = cdf_bounds(family, bits)
        need = level * (1 << bits)
        q = bisect.bisect_left(low, math.ceil(need))
        if q == len(low):
            raise ValueError(
                f"confidence {float(level)!r} is too close to 1 for the noise's certified "
                "table; use a lower confidence"
            )
        if q == 0 or high[q - 1] < need:
            return q  # proven least
        bits += 64
    return q  # covers; the least is q or q - 1, undecided at this precision


def least_noise_within(error: float, level: float, plan_for: Callable[[float], NoisePlan]) -> float:
    """The largest Gaussian noise multiplier (the least privacy charged) whose interval at
    ``level`` has half-width at most ``error``, for ``plan_for(z)`` the noise of
    ``GaussianMechanism(z)`` as the release would add it.

    The search is the calibration's bisection (``plan_noise_multiplier_where``) over
    ``1 / z``: it returns only a value checked to fit, to a relative 1e-10, so the
    interval of the mechanism returned is within ``error`` by construction. Multipliers
    above 1000 are not considered (an error that large needs no more noise than that).
    A multiplier whose noise cannot be planned (a declared granularity too fine for it)
    does not fit.
    """
    error = check.positive("error", error)
    level = check_confidence("level", level)

    def fits(noise_multiplier: float) -> bool:
        try:
            plan = plan_for(noise_multiplier)
        except ValueError:
            return False
        return half_width(plan, level) <= error

    inverse = plan_noise_multiplier_where(
        lambda u: fits(1.0 / u), f"an interval of half-width {error} at level {level}"
    )
    noise_multiplier = 1.0 / inverse
    if not fits(noise_multiplier):  # the bisection checked 1/u: the same float
        raise ValueError(f"no noise multiplier keeps the interval within {error}")
    return noise_multiplier
