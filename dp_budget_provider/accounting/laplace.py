"""Rényi-DP curve of continuous Laplace noise, within 2^-46 relative of exact.

The curve (Mironov 2017, Prop. 6), for eps0 = e and order a > 1, is
``R = log(a/(2a-1) e^{(a-1)e} + (a-1)/(2a-1) e^{-ae}) / (a-1)``. That form cancels at
small e (R ~ a e^2 / 2) and overflows at large (a-1) e. With x1 = (a-1) e, r = a e,
w = (a-1)/a and g(x) = e^x - 1 - x >= 0 (the linear parts a x1 and (a-1) r cancel exactly)

    R = log1p(P) / (a-1),   P = (g(x1) + w g(-r)) / (1 + w),

a sum of non-negative terms. ``g`` as ``expm1(x) - x`` loses ~2u/|x| relative at small
|x|, so each (eps0, order) is evaluated in one of three regions, chosen by the computed
r and x1 (a test one rounding off moves the constants below by ~u relative).
u = 2^-53; numpy's ``expm1`` and ``log1p`` are taken to be within 4 ulps (8u relative;
numpy's own float64 accuracy tests allow 3 and 2 ulps for its vector loops).

**r < 1: a series in e, as one matrix product.** Expanding g,
P = a(a-1) e^2 S with S = sum_{k>=2} b_k e^{k-2} and exact per-order coefficients
b_k = ((a-1)^{k-1} + (-1)^k a^{k-1}) / ((2a-1) k!), b_2 = 1/2. As
|(a-1)^{k-1} + (-1)^k a^{k-1}| <= a^{k-2} (2a-1), each term is at most r^{k-2}/k!, and as
g(x) >= x^2/2 for x >= 0 and g(-r) >= (r^2/2)(1 - r/3), S >= (1 - r/3)/2 >= 1/3. So:

* the terms past k = 18 sum to under 1/19! * 20/19 < 8.7e-18, 0.24u of S;
* the magnitudes of the terms sum to at most 1/2 + (e - 5/2) < 0.72 <= 2.16 S. The
  coefficients b_k / sigma^{k-2} are rounded once from exact integers (a = p/q), the
  powers (sigma e)^{k-2} take k - 3 roundings, and the product is a dot product of 17
  terms, within gamma_17 of the magnitudes in any order, with or without fused
  multiply-adds (Higham, *Accuracy and Stability of Numerical Algorithms*, Sec. 3.1):
  17 * 2.16 u, and under 1u more for the coefficients and powers (weights (k-2)/k!).
  S is within 38u.
* Q = a e^2 S = P / (a-1) as ((S a) e) e takes 3 roundings, P = Q fl(a-1) 2 more, and
  R = log1p(P) / fl(a-1) log1p's 8u and the division's u. An error of P reaches
  log1p(P) at most 1:1 (P / ((1 + P) log1p(P)) <= 1), and the rounding of a-1 enters
  P and the division alike (log1p(P)/P moves by at most P/2 <= 0.36 of it). R is within
  53u. Where P <= 2^-60, R = Q, at most 2^-61 above exact (log1p(P) >= P (1 - P/2)).

sigma is the power of two at or below the largest order of a group of orders spanning at
most 48 binades, within a factor 2 of it: every coefficient is below 2^{k-2}/k!, and
sigma e < 2^48 wherever an order of the group has r < 1, so every power is in range. A
power or coefficient that underflows belongs to a term below 2^-300 of S.

**r >= 1, x1 < 8: g = expm1(x) - x directly**, now harmless. Relative to
g(x1) + w g(-r): expm1's 8u at x1 weighs at most 4.68 * 8u (for x1 >= 1,
expm1/g <= 2.39; below, expm1(x1) <= 1.72 x1 = 1.72 w r, against w g(-r) with
r / g(-r) <= e), at -r at most 1.72 * 8u ((1 - e^{-r}) / g(-r) <= 1.72). The roundings
of x1 (2u) and r (u) move P by at most 2.91 * 2u and 1.72u relative (x g'(x)/g(x),
for x1 <= 2; beyond, R moves by at most 2u e and R >= e (1 - log 2 / x1) >= 0.65 e).
With the 11 other roundings (w's 2, the 2 differences, the product, the sum, 1 + w,
the division, a-1 and the last division) and log1p's 8u, R is within 78u.

**x1 >= 8: the factored form** R = e + log1p(w/(1+w) expm1(-(x1 + r))) / (a-1), which
cannot overflow. The correction is in [-log 2 / (a-1), 0], at most 0.095 R, and is
itself within ~19u (its log1p argument is in (-1/2, 0), where log1p's condition number
is at most 1.45), so R is within 3u.

Every R is thus within 2^-46 (128u) of exact, a quarter of what the conversion's
``CURVE_ROUNDING`` allows for (2^-44). Where R is below 2^-1022 (eps0 below ~1e-150,
or orders near 2^1024) the roundings are absolute instead, together at most 2^-1074
(only the last products can be subnormal; where an earlier one is, R is below 2^-2000),
so 2^-1073 is added there: such a curve is never 0, nor below exact.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dp_budget_provider.accounting.rounding import not_vanishing

_TERMS = 17  # k = 2, ..., 18 of the series
_SERIES_BELOW = 1.0  # r = a * eps0
_FACTORED_FROM = 8.0  # x1 = (a - 1) * eps0
_BINADES_PER_GROUP = 48
_TINY_P = 2.0**-60  # at most this, R = Q

_Group = tuple[np.ndarray, float, float, np.ndarray]


def laplace_rdp(epsilon0: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """The curve of each eps0 (a 1-D array, all > 0) on ``orders`` (all > 1, finite),
    one row per eps0, within 2^-46 relative of exact (module docstring)."""
    e = np.asarray(epsilon0, dtype=np.float64)
    grid = np.ascontiguousarray(orders, dtype=np.float64)
    column = e[:, None]
    # Overflows and NaNs arise only in values a region's test then discards.
    with np.errstate(over="ignore", invalid="ignore"):
        quotient = _series(e, grid)
        quotient *= grid
        quotient *= column
        quotient *= column  # Q = a e^2 S = P / (a - 1), each product at most the one before
        curve = quotient * (grid - 1.0)  # P
        tiny_p = curve <= _TINY_P
        np.log1p(curve, out=curve)
        curve /= grid - 1.0  # R = log1p(P) / (a - 1) ...
        np.copyto(curve, quotient, where=tiny_p)  # ... and Q where P is tiny
        # r >= 1 only in the columns where it holds for the largest eps0 (rounding is
        # monotonic): the far region is found and computed there.
        far_columns = np.flatnonzero(grid * e.max(initial=0.0) >= _SERIES_BELOW)
        rows, which = np.nonzero(column * grid[far_columns] >= _SERIES_BELOW)
        columns = far_columns[which]
        curve[rows, columns] = _far_from_zero(e[rows], grid[columns])
    return not_vanishing(curve)


def _series(e: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """S = sum_k b_k e^{k-2} for every (eps0, order), as the module docstring bounds it
    where r < 1; elsewhere a value the caller replaces."""
    plan = _plan(grid.tobytes())
    if len(plan) == 1:
        return _group_series(e, *plan[0][1:])
    series = np.empty((e.size, grid.size))
    for columns, *group in plan:
        series[:, columns] = _group_series(e, *group)
    return series


def _group_series(
    e: np.ndarray, scale: float, smallest: float, coefficients: np.ndarray
) -> np.ndarray:
    # Rows where no order of the group has r < 1 get t = 0 (their S is replaced).
    t = np.where(e * smallest < _SERIES_BELOW, e * scale, 0.0)
    powers = np.empty((e.size, _TERMS))
    powers[:, 0] = 1.0
    np.cumprod(np.broadcast_to(t[:, None], (e.size, _TERMS - 1)), axis=1, out=powers[:, 1:])
    return powers @ coefficients


@functools.lru_cache(maxsize=32)
def _plan(grid: bytes) -> tuple[_Group, ...]:
    """Per group of orders spanning at most 48 binades: its columns, its scale sigma,
    its smallest order and its coefficients b_k / sigma^{k-2} (one column per order).
    Computed once per grid; the cached arrays are read-only."""
    orders = np.frombuffer(grid, dtype=np.float64)
    exponents = np.frexp(orders)[1]  # order in [2^(E-1), 2^E)
    group_of = (exponents - 1) // _BINADES_PER_GROUP
    plan = []
    for group in np.unique(group_of):
        columns = np.flatnonzero(group_of == group)
        scale_exponent = int(exponents[columns].max()) - 1  # sigma <= largest < 2 sigma
        coefficients = np.array(
            [
                [_coefficient(float(orders[j]), k, scale_exponent) for j in columns]
                for k in range(2, 2 + _TERMS)
            ]
        )
        for array in (columns, coefficients):
            array.flags.writeable = False
        plan.append((columns, 2.0**scale_exponent, float(orders[columns].min()), coefficients))
    return tuple(plan)


def _coefficient(order: float, k: int, scale_exponent: int) -> float:
    """b_k / 2^(scale_exponent (k-2)), correctly rounded: with order = p/q exactly,
    b_k = ((p-q)^{k-1} + (-1)^k p^{k-1}) / (q^{k-2} (2p-q) k!), in integers."""
    p, q = order.as_integer_ratio()
    numerator = (p - q) ** (k - 1) + (-1) ** k * p ** (k - 1)
    denominator = (q ** (k - 2) * (2 * p - q) * math.factorial(k)) << (scale_exponent * (k - 2))
    return numerator / denominator


def _far_from_zero(e: np.ndarray, a: np.ndarray) -> np.ndarray:
    """R where r >= 1, on 1-D arrays of eps0 and orders: ``expm1(x) - x`` while x1 < 8,
    the factored form beyond (module docstring). Each is computed everywhere and kept
    where it applies, under the caller's ``errstate``."""
    r = a * e
    excess = (a - 1.0) * e  # x1
    w = (a - 1.0) / a
    p = (np.expm1(excess) - excess + w * (np.expm1(-r) + r)) / (1.0 + w)
    accurate = np.log1p(p) / (a - 1.0)
    factored = e + np.log1p(w / (1.0 + w) * np.expm1(-(excess + r))) / (a - 1.0)
    return np.where(excess < _FACTORED_FROM, accurate, factored)


__all__ = ["laplace_rdp"]
