"""Sums of privacy costs rounded upward: never below the exact sum of what they add.

Round-to-nearest lets a sum drift below the exact total, a little per addition and
without bound in their number: an epsilon below the true loss. Every sum of costs (an
accountant's composition, the ledger's stored spend) is therefore made with one of these.
All operands are non-negative doubles (costs); u = 2^-53 is the unit roundoff.

* :func:`sum_up`, one addition: ``(a + b) * ROUND_UP``. In the normal range
  fl(a + b) >= (a + b)(1 - u), so fl(fl(a + b)(1 + 4u)) >= (a + b)(1 - u)^2 (1 + 4u)
  = (a + b)(1 + 2u - 7u^2 + 4u^3) >= a + b; a subnormal sum is exact, and rounding the
  product cannot go below it. The same holds for a difference a - b >= 0
  (:func:`difference_up`), whose rounding is also within u relative. Each costs at most
  ~5u relative (5e-10 after 10^6 of them). Adding or taking away zero rounds nothing and
  is left exact (a cost charged once is held exactly). The factor 1 + 2^-51 is exact in
  a double, so the ledger's SQL updates bind the same factor and make the same sums.
* :func:`dot_up`, n terms at once (a vectorised composition): ``counts @ values``
  raised by F = 1 + (k + 1) 2^-52 = 1 + 2 (k + 1) u, where k bounds the roundings any one
  term goes through. Whatever the order and blocking of the sum, and with or without
  fused multiply-adds, |fl(sum) - sum| <= gamma_k sum for non-negative terms, with
  gamma_k = k u / (1 - k u) (Higham, *Accuracy and Stability of Numerical Algorithms*,
  2nd ed.: inner products, Sec. 3.1; any summation order, Ch. 4). So
  sum <= fl(sum) / (1 - gamma_k) = fl(sum) (1 + k u / (1 - 2 k u)) <= fl(sum)(1 + 2 k u)
  for k u <= 1/4, and the product by F, itself rounded, is at least
  fl(sum) F (1 - u) >= fl(sum)(1 + 2 k u) for (k + 1) u <= 1/2. F is exact in a double.
  Underflow cannot break this: counts are integers, so every exact intermediate (a
  product, a sum, a fused multiply-add) is a multiple of 2^-1074 and is represented
  exactly wherever it is subnormal; in the normal range each rounding is within u.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

ROUND_UP = 1.0 + 2.0**-51
_TWO_U = 2.0**-52  # twice the unit roundoff
SMALLEST_NORMAL = 2.0**-1022
SUBNORMAL_ALLOWANCE = 2.0**-1073  # two steps of the subnormal spacing 2^-1074


def sum_up(a: Any, b: Any) -> Any:
    """a + b rounded up (floats or arrays of them). Adding zero is exact, so it is not
    raised: a cost composed onto nothing is held exactly."""
    total = a + b
    if isinstance(total, np.ndarray):
        return np.where((np.asarray(a) == 0.0) | (np.asarray(b) == 0.0), total, total * ROUND_UP)
    return total if a == 0.0 or b == 0.0 else total * ROUND_UP


def difference_up(a: Any, b: Any) -> Any:
    """max(0, a - b) rounded up (floats or arrays); taking nothing away is exact."""
    difference = a - b
    if isinstance(difference, np.ndarray):
        raised = np.where(np.asarray(b) == 0.0, difference, difference * ROUND_UP)
        return np.maximum(0.0, raised)
    return max(0.0, difference if b == 0.0 else difference * ROUND_UP)


def dot_up(counts: np.ndarray, values: np.ndarray) -> Any:
    """An upper bound of the exact ``counts @ values``: n costs, each invoked
    ``counts[i]`` times, summed (``values`` of shape (n,) or (n, orders)).

    ``counts`` are integers up to 2^53 (exact as doubles) and ``values`` non-negative
    (+inf is kept). One term of count 1 is returned exactly; otherwise every term goes
    through at most k = n roundings (its product and n - 1 additions; n - 1 when every
    count is 1) and the sum is raised as the module docstring proves.
    """
    counts = np.asarray(counts, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    n = counts.shape[0]
    if n == 1 and counts[0] == 1.0:  # the common single release: nothing rounds
        return values[0]
    roundings = n - 1 if bool(np.all(counts == 1.0)) else n
    with np.errstate(over="ignore"):  # +inf is an upper bound
        return (counts @ values) * (1.0 + (roundings + 1) * _TWO_U)


def not_vanishing(values: np.ndarray) -> np.ndarray:
    """``values`` (non-negative costs; changed in place and returned) raised by
    :data:`SUBNORMAL_ALLOWANCE` wherever they fell below the normal range.

    There a double keeps an absolute precision of 2^-1074, not a relative one: a cost
    computed as a subnormal is off by up to a step per rounding, and one that underflowed
    reads 0 although its mechanism leaks. Raised, it stays an upper bound, and a mechanism
    with any privacy loss never gets an all-zero curve, which the conversion reports as
    eps = 0 (nothing released) even at a delta below the mechanism's total-variation
    distance. A value about to be divided by a - 1 < 1 (which scales its error up) is
    raised before the division as well as after it.
    """
    values[values < SMALLEST_NORMAL] += SUBNORMAL_ALLOWANCE
    return values


__all__ = [
    "ROUND_UP",
    "SMALLEST_NORMAL",
    "SUBNORMAL_ALLOWANCE",
    "difference_up",
    "dot_up",
    "not_vanishing",
    "sum_up",
]


def float_at_least(value: Fraction) -> float:
    """The nearest float >= ``value`` (exact): a cost or a sensitivity is never rounded
    down."""
    as_float = float(value)
    return as_float if Fraction(as_float) >= value else math.nextafter(as_float, math.inf)


def sqrt_at_least(square: Fraction) -> float:
    """The nearest float >= ``sqrt(square)`` (exact, ``square >= 0``): a Euclidean norm of
    exact moves, never rounded down."""
    root = math.sqrt(float(square))
    while Fraction(root) ** 2 < square:
        root = math.nextafter(root, math.inf)
    while root > 0 and Fraction(math.nextafter(root, 0.0)) ** 2 >= square:
        root = math.nextafter(root, 0.0)
    return root
