"""Logarithms of normal tail probabilities, accurate far into both tails.

The exact Gaussian privacy curve and the subsampled-Gaussian series evaluate normal
tail probabilities where ``math.erfc`` underflows, so we work with logs. Pure
standard library and numpy: the accounting layer stays importable without scipy.
"""

from __future__ import annotations

import math

import numpy as np

_LOG_2 = math.log(2.0)
_HALF_LOG_PI = 0.5 * math.log(math.pi)
_SQRT_2 = math.sqrt(2.0)

# log erfc(x) regions. At x <= -6, erfc(x) = 2 - erfc(-x) and erfc(6) / 2 ~ 1e-17, which
# is below half an ulp of log(2). So log(2) is the correctly rounded value.
# Between -6 and 8, math.erfc is accurate to a few ulps and far from underflow
# (erfc(8) ~ 1e-29). At x >= 8 the asymptotic series below has converged to
# about 1e-19 relative.
_ERFC_IS_TWO_BELOW = -6.0
_ERFC_ASYMPTOTIC_FROM = 8.0
_ERFC_MAX_ASYMPTOTIC_TERMS = 20
_ERFC_ASYMPTOTIC_BANDS = (12.0, 24.0, 100.0, 1e4)


def _log_erfc_asymptotic(x: np.ndarray) -> np.ndarray:
    """log erfc(x) for x >= 8 from the asymptotic expansion.

    erfc(x) ~ exp(-x^2) / (x sqrt(pi)) * (1 - 1/(2x^2) + 3/(2x^2)^2 - 15/(2x^2)^3 + ...).
    The sum is computed by Horner's rule in t = 1/(2x^2). The k-th term is
    (2k-1)!! t^k; we use just enough terms to bring the first dropped term below
    1e-18 at the smallest x in ``x``.
    """
    with np.errstate(over="ignore"):
        x2 = x * x  # overflows to inf for x > 1e154; the result is then -inf
    t = 0.5 / x2
    t_max = float(np.max(t)) if t.size else 0.0
    n_terms = 0
    bound = t_max
    while n_terms < _ERFC_MAX_ASYMPTOTIC_TERMS and bound > 1e-18:
        n_terms += 1
        bound *= (2 * n_terms + 1) * t_max
    series = np.ones_like(x)
    for k in range(n_terms, 0, -1):
        series = 1.0 - (2 * k - 1) * t * series
    return -x2 - np.log(x) - _HALF_LOG_PI + np.log(series)


def log_erfc(x: np.ndarray) -> np.ndarray:
    """Elementwise log(erfc(x)), accurate deep into both tails (NaN in, NaN out).

    Stands in for dp_accounting's ``log(2) + scipy.special.log_ndtr(-sqrt(2) x)``.
    """
    x = np.asarray(x, dtype=np.float64)
    out = np.full(x.shape, _LOG_2)  # x <= -6 and x == -inf: erfc(x) == 2 to double precision
    middle = (x > _ERFC_IS_TWO_BELOW) & (x < _ERFC_ASYMPTOTIC_FROM)
    if middle.any():
        log, erfc = math.log, math.erfc
        out[middle] = [log(erfc(v)) for v in x[middle].tolist()]
    # Split the tail into bands so each band only evaluates the terms it needs.
    lower = _ERFC_ASYMPTOTIC_FROM
    for upper in (*_ERFC_ASYMPTOTIC_BANDS, math.inf):
        band = (x >= lower) & (x < upper) if upper != math.inf else (x >= lower)
        if band.any():
            out[band] = _log_erfc_asymptotic(x[band])
        lower = upper
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.nan
    return out


def log_ndtr(x: float) -> float:
    """log(Phi(x)) for the standard normal CDF Phi (scalar, for the exact-Gaussian searches).

    Phi(x) = erfc(-x / sqrt(2)) / 2. For x >= 0 ``log1p`` keeps the tiny distance to
    1 exact; in the middle ``math.erfc`` is accurate; the far left tail uses the same
    asymptotic series as :func:`log_erfc`.
    """
    if x >= 0.0:
        return math.log1p(-0.5 * math.erfc(x / _SQRT_2))
    argument = -x / _SQRT_2
    if argument < _ERFC_ASYMPTOTIC_FROM:
        return math.log(0.5 * math.erfc(argument))
    return float(_log_erfc_asymptotic(np.array([argument]))[0]) - _LOG_2
