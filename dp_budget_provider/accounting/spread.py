"""The standard deviation of the noise a release adds, as it is drawn.

A release's guarantee says how much noise its numbers carry, so that whoever reads them
can judge their accuracy without knowing the mechanism's parametrisation. The number is
the standard deviation of the noise actually added, not of the mechanism named:

* continuous Gaussian: ``sigma``; continuous Laplace of scale ``b``: ``b * sqrt(2)``;
* discrete Gaussian (Canonne, Kamath, Steinke 2020), P[y] proportional to
  exp(-y^2 / (2 s^2)) on the integers: its variance is below ``s^2`` (as they show) and
  equal to it up to a relative ``O(s^2 exp(-2 pi^2 s^2))`` (Poisson summation), under
  1e-300 from ``s = 6`` on; below that it is summed directly;
* discrete Laplace (two-sided geometric), P[y] proportional to exp(-|y| / t): variance
  ``2 q / (1 - q)^2`` with ``q = exp(-1/t)``, which tends to ``2 t^2`` for large ``t``.

The discrete spreads are in lattice units, at the parameter the samplers really use
(``effective_*``: at most a relative 2**-23 above the one asked for).

Layering: standard library only, plus the samplers' effective parameters.
"""

from __future__ import annotations

import math
from fractions import Fraction

from dp_budget_provider.accounting.noise import (
    effective_discrete_gaussian_sigma2,
    effective_discrete_laplace_scale,
)

#: From this sigma (in lattice units) on, the discrete Gaussian's variance is sigma^2 to
#: far below float precision (relative error under 1e-300), so it is not summed.
_SUMMED_BELOW = 6.0


def gaussian_std(sigma: float) -> float:
    """Standard deviation of continuous Gaussian noise of scale ``sigma``."""
    return float(sigma)


def laplace_std(scale: float) -> float:
    """Standard deviation of continuous Laplace noise of scale ``scale``: ``scale*sqrt(2)``."""
    return float(scale) * math.sqrt(2.0)


def discrete_gaussian_std(sigma_units: Fraction | float) -> float:
    """Standard deviation, in lattice units, of the discrete Gaussian the sampler draws
    for ``sigma_units``."""
    variance = float(effective_discrete_gaussian_sigma2(sigma_units))
    sigma = math.sqrt(variance)
    if sigma >= _SUMMED_BELOW:
        return sigma
    # Terms past 40 sigma are below exp(-800): nothing a double can hold.
    reach = math.ceil(40 * sigma) + 1
    weights = [math.exp(-(y * y) / (2 * variance)) for y in range(1, reach + 1)]
    total = 1.0 + 2.0 * math.fsum(weights)
    second_moment = 2.0 * math.fsum(y * y * w for y, w in enumerate(weights, start=1))
    return math.sqrt(second_moment / total)


def discrete_laplace_std(scale_units: Fraction | float) -> float:
    """Standard deviation, in lattice units, of the discrete Laplace the sampler draws for
    ``scale_units``: ``sqrt(2 q) / (1 - q)`` with ``q = exp(-1/t)`` (``expm1`` keeps
    ``1 - q`` exact for large ``t``)."""
    t = float(effective_discrete_laplace_scale(scale_units))
    q = math.exp(-1.0 / t)
    return math.sqrt(2.0 * q) / -math.expm1(-1.0 / t)
